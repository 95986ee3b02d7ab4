"""A host's pool of pre-started worker processes, and the workers they became (Prism's fast activation).

It keeps `host_standbys` standbys (llmesh.engine.standby: imports done, no model) ready for each role
that the catalogue's models need (decode only where all are aggregated), on
the cores the launcher gives that role's engines, and answers `ActivateCommand`s (`Subjects.activate`)
from placement: a ready standby of the role becomes the worker of the model named (1.7 s to its first
heartbeat for the tiny model, against 37 s cold: docs/benchmarks.md), and a new standby is started in
its place once the new worker beats (or after `host_refill_wait_s`): a standby's imports on the same
cores would slow the worker's start (an activation took 25-30 s beside them under load, 2 s without).
With none ready, the worker starts cold: slower, but the command is not refused for it.
Every `host_heartbeat_s` it publishes `HostInfo`: its ready standbys, its workers and its memory
budget, which placement weighs models against.

It stops no worker itself: placement drains one (it exits once empty, status 0) and the agent notices.
A worker that fails is reported gone, not restarted: placement activates the model again if its
requests still need it. When the agent stops, its standbys and workers stop with it.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmesh.deploy.launcher import (
    Child,
    activate,
    catalogue_roles,
    engine_cores,
    standby_ready,
    start_service,
    start_standby,
    stop_all,
)
from llmesh.wire.bus import Bus
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import (
    ActivateCommand,
    ActivateOutcome,
    HostedWorker,
    HostInfo,
    Message,
    Subjects,
    WorkerInfo,
)

from .settings import HostAgentSettings

log = logging.getLogger(__name__)

StartStandby = Callable[[str, Path], Child]  # (role, log path) -> a started standby
StartCold = Callable[[str, dict[str, str], Path, str], Child]  # (service, env, log path, name) -> a started worker


@dataclass
class _Worker:
    child: Child
    info: HostedWorker
    started_at: float
    joined: bool = False  # its first heartbeat was heard


class HostAgent:
    def __init__(
        self,
        bus: Bus,
        settings: HostAgentSettings,
        start: StartStandby | None = None,
        start_cold: StartCold = start_service,
    ):
        """`start`: how a standby of a role starts (default: llmesh.engine.standby on the role's cores);
        `start_cold`: how a worker starts when no standby is ready (default: `python -m` its service)."""
        self.bus, self.settings, self.host_id = bus, settings, settings.host()
        self.log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="llmesh-host-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        roles = catalogue_roles(settings.catalogue())
        cores = engine_cores(roles=roles, engines=settings.host_engines or len(settings.catalogue()))
        self._start = start or (
            lambda role, path: start_standby(cores.get(f"{role}-worker", {}), path, f"standby-{role}")
        )
        self._cores, self._start_cold = cores, start_cold
        self.standbys: dict[str, list[Child]] = {role: [] for role in sorted(roles)}
        self.workers: dict[str, _Worker] = {}
        self._started = 0  # processes started, for their log names
        self._lock = asyncio.Lock()  # one activation at a time: each takes a standby and starts another

    async def start(self) -> None:
        self._refill()
        await self.bus.serve(Subjects.activate(self.host_id), self._on_activate, span="host activate")
        await self.bus.serve(Subjects.HEARTBEAT, self._on_worker_heartbeat, traced=False)
        log.info(
            "host agent %s: %d standby(s) per role, %.1f GiB for models, logs in %s",
            self.host_id,
            self.settings.host_standbys,
            self.settings.memory_bytes() / 2**30,
            self.log_dir,
        )

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.check()
            try:
                await self.bus.publish(Subjects.HOST_HEARTBEAT, self.info())
            except Exception as exc:  # NATS away for a moment: the next beat tells
                log.warning("could not publish the heartbeat: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.settings.host_heartbeat_s)
            except TimeoutError:
                pass

    def close(self) -> None:
        stop_all([*(c for pool in self.standbys.values() for c in pool), *(w.child for w in self.workers.values())])

    def info(self) -> HostInfo:
        return HostInfo(
            host_id=self.host_id,
            heartbeat_s=self.settings.host_heartbeat_s,
            standbys={role: sum(map(standby_ready, pool)) for role, pool in self.standbys.items()},
            workers=[w.info for w in self.workers.values()],
            memory_bytes=self.settings.memory_bytes(),
        )

    def check(self) -> None:
        """Forget what exited (saying why) and start standbys up to the pool's size."""
        for role, pool in self.standbys.items():
            for child in [c for c in pool if not c.alive()]:
                log.warning("a %s standby exited with %s:\n%s", role, child.proc.returncode, child.log_tail(10))
                child.stop()
                pool.remove(child)
        for worker_id, worker in list(self.workers.items()):
            if not worker.child.alive():
                code = worker.child.proc.returncode
                if code == 0:
                    log.info("worker %s exited (drained)", worker_id)
                else:
                    log.warning("worker %s exited with %s:\n%s", worker_id, code, worker.child.log_tail(20))
                worker.child.stop()
                del self.workers[worker_id]
        self._refill()

    async def _on_worker_heartbeat(self, info: Message, blob: memoryview) -> None:
        if isinstance(info, WorkerInfo):
            self.joined(info.worker_id)

    def joined(self, worker_id: str) -> None:
        """`worker_id` beats: if it is one of ours, its start no longer holds back the refill."""
        worker = self.workers.get(worker_id)
        if worker is not None and not worker.joined:
            worker.joined = True
            self._refill()

    def _starting(self) -> bool:
        """A worker started here has not beaten yet, within `host_refill_wait_s`."""
        now = time.monotonic()
        return any(
            not w.joined and now - w.started_at < self.settings.host_refill_wait_s for w in self.workers.values()
        )

    def _refill(self) -> None:
        if self._starting():
            return  # after it: a standby's imports would slow its start on the same cores
        for role, pool in self.standbys.items():
            while len(pool) < self.settings.host_standbys:
                pool.append(self._start(role, self._log_path(f"standby-{role}")))

    def _log_path(self, name: str) -> Path:
        self._started += 1
        return self.log_dir / f"{name}-{self._started}.log"

    async def _on_activate(self, cmd: Message, blob: memoryview) -> ActivateOutcome:
        if not isinstance(cmd, ActivateCommand):
            raise InvalidRequest(f"expected ActivateCommand, got {type(cmd).__name__}")
        async with self._lock:
            return self.activate(cmd)

    def activate(self, cmd: ActivateCommand) -> ActivateOutcome:
        """Start `cmd`'s worker: from a ready standby of its role, else cold."""
        refused = self._refusal(cmd)
        if refused:
            log.warning("activation of %s (%s) refused: %s", cmd.worker_id, cmd.model, refused)
            return ActivateOutcome(
                command_id=cmd.command_id, host_id=self.host_id, worker_id=cmd.worker_id, accepted=False, reason=refused
            )
        service = f"{cmd.role}-worker"
        env = {"MESH_SERVED_MODEL_NAME": cmd.model, "MESH_WORKER_ID": cmd.worker_id, "MESH_HOST_ID": self.host_id}
        if cmd.kv_cache_bytes:
            env["MESH_KV_CACHE_BYTES"] = str(cmd.kv_cache_bytes)
        pool = self.standbys[cmd.role]
        standby = next((c for c in pool if c.alive() and standby_ready(c)), None)
        if standby is not None:
            pool.remove(standby)
            activate(standby, service, env)
            child, how = standby, "from a standby"
        else:
            env |= self._cores.get(service, {})
            child = self._start_cold(service, env, self._log_path(cmd.worker_id), cmd.worker_id)
            how = "cold (no standby ready)"
        self.workers[cmd.worker_id] = _Worker(
            child,
            HostedWorker(worker_id=cmd.worker_id, model=cmd.model, role=cmd.role, kv_cache_bytes=cmd.kv_cache_bytes),
            time.monotonic(),
        )
        log.info("worker %s (%s, %s) started %s: log %s", cmd.worker_id, cmd.model, cmd.role, how, child.log_path)
        self._refill()
        return ActivateOutcome(
            command_id=cmd.command_id, host_id=self.host_id, worker_id=cmd.worker_id, accepted=True, reason=how
        )

    def _refusal(self, cmd: ActivateCommand) -> str:
        if cmd.worker_id in self.workers:
            return f"{cmd.worker_id} runs here already"
        model = next((m for m in self.settings.catalogue() if m.name == cmd.model), None)
        if model is None:
            return f"{cmd.model!r} is not in this host's catalogue (MESH_MODELS)"
        if cmd.role not in model.roles:
            return f"{cmd.model} is served by {' and '.join(model.roles)} workers only, not {cmd.role}"
        if model.tensor_parallel_size != 1:
            return f"{cmd.model} needs {model.tensor_parallel_size} tensor-parallel ranks; standbys here have one"
        given = sum(w.info.kv_cache_bytes for w in self.workers.values())
        if given + cmd.kv_cache_bytes > self.settings.memory_bytes():
            return (
                f"{cmd.kv_cache_bytes} bytes of KV would exceed this host's budget "
                f"({self.settings.memory_bytes()}, {given} given to its workers)"
            )
        return ""
