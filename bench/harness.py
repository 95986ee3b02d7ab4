"""The mesh as the benchmarks start it (`make run`'s launcher, its state in a folder of the run's), and the CPU
time the processes of a deployment take."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from llmesh.deploy.credentials import EVERYTHING, load_or_create
from llmesh.deploy.launcher import Child, free_port, wait_healthy
from llmesh.wire.secrets import MeshSecrets

MAX_MODEL_LEN, BLOCK_SIZE = 2048, 128  # every benchmarked engine's, unless a benchmark says otherwise
BENCH_USER = "bench"  # the benchmark's own NATS user: it plays any part (sends what the router or placement would)


@dataclass
class LaunchedMesh:
    """A started launcher, and how to reach what it runs. As a context manager, stopped on leaving."""

    launcher: Child
    env: dict[str, str]  # its environment: ports, state folders, and the settings each of its services takes
    secrets: MeshSecrets

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['MESH_PORT']}"

    @property
    def headers(self) -> dict[str, str]:
        """The API key."""
        return {"Authorization": f"Bearer {self.secrets.api_key}"}

    @property
    def nats_url(self) -> str:
        """As BENCH_USER."""
        return self.secrets.nats_url(self.service_env()["MESH_NATS_URL"], BENCH_USER)

    def service_env(self, **env: str) -> dict[str, str]:
        """The environment of a service started beside the launcher's (another worker), to join them: the
        launcher's with the NATS and Redis it gives its own (each takes its credentials from the secrets)."""
        return (
            self.env
            | {
                "MESH_NATS_URL": f"nats://127.0.0.1:{self.env['MESH_NATS_PORT']}",
                "MESH_REDIS_URL": f"redis://127.0.0.1:{self.env['MESH_REDIS_PORT']}/0",
            }
            | env
        )

    def __enter__(self) -> LaunchedMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.launcher.stop(60)


def start_mesh(work: Path, model_dir: Path, name: str = "mesh", **env: str) -> LaunchedMesh:
    """`make run`'s launcher on free ports, its state (secrets, logs, KV, its own log) under `work`, engines of
    MAX_MODEL_LEN and BLOCK_SIZE; `env` over all that. Not waited for (`launch_mesh` is)."""
    secrets = load_or_create(work / "secrets", extra_users={BENCH_USER: EVERYTHING})
    env = {
        "MESH_SECRETS_DIR": str(work / "secrets"),
        "MESH_PORT": str(free_port()),
        "MESH_NATS_PORT": str(free_port()),
        "MESH_REDIS_PORT": str(free_port()),
        "MESH_MODEL_DIR": str(model_dir),
        "MESH_LOG_DIR": str(work / "logs"),
        "MESH_DATA_DIR": str(work / "kv"),
        "MESH_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "MESH_BLOCK_SIZE": str(BLOCK_SIZE),
    } | env
    launcher = Child(name, [sys.executable, "-m", "llmesh.deploy.launcher"], env=env, log_path=work / "launcher.log")
    return LaunchedMesh(launcher, env, secrets)


def launch_mesh(work: Path, model_dir: Path, timeout: float = 900, **env: str) -> LaunchedMesh:
    """`start_mesh`'s, returned once healthy. Stop it by leaving it as a context manager or `.launcher.stop()`."""
    mesh = start_mesh(work, model_dir, **env)
    try:
        wait_healthy(mesh.url, timeout, [mesh.launcher])
    except BaseException:
        mesh.launcher.stop(30)
        raise
    return mesh


# ---- processes and their CPU time -----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, command name, CPU seconds) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            head, rest = f.read().rsplit(")", 1)
    except OSError:
        return None
    fields = rest.split()
    return int(fields[1]), head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _label(pid: int, comm: str) -> str:
    """A process's name in the tables: the module a Python service runs, else its command."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        args = []
    if comm.startswith("VLLM::"):  # an engine's scheduler (EngineCore) or model executor (Worker)
        return "engine-" + comm.removeprefix("VLLM::").lower()
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1].removeprefix("llmesh_").removeprefix("vllm.entrypoints.openai.")
    return Path(args[0]).name if args and args[0] else comm


def cpu_by_process(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of every process under each root, keyed 'root/process'."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _, _) in stats.items():
        children[ppid].append(pid)
    out: dict[str, float] = defaultdict(float)
    for root_name, root in roots.items():
        todo = [(root, root_name)]
        while todo:
            pid, owner = todo.pop()
            if pid not in stats:
                continue
            label = _label(pid, stats[pid][1])
            name = root_name if pid == root else label if owner == root_name else f"{owner}/{label}"
            out[f"{root_name}:{name}" if pid != root else root_name] += stats[pid][2]
            todo += [(child, name if pid != root else root_name) for child in children[pid]]
    return dict(out)


def cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process took between two `cpu_by_process` readings (those that took any)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def is_engine(process: str) -> bool:
    return process.rsplit("/", 1)[-1].rsplit(":", 1)[-1].startswith("engine-")
