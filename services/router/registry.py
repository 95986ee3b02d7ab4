"""Live workers, learned from heartbeats; dead ones are dropped and whoever watches them is told."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from llmesh.errors import ModelNotFound, ServiceUnavailable, WorkerLost
from llmesh.messages import WorkerInfo
from llmesh.policies import POLICIES, WorkerSnapshot

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    info: WorkerInfo
    last_seen: float
    assigned: int = 0  # requests sent since its last heartbeat
    watchers: set[Callable[[BaseException], None]] = field(default_factory=set)


class WorkerRegistry:
    def __init__(self, missed_heartbeats: int = 3, policy: str = "least_loaded", seed: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self._workers: dict[str, _Entry] = {}
        self._missed = missed_heartbeats
        self._policy = POLICIES[policy]
        self._rng = random.Random(seed)
        self._clock = clock

    def on_heartbeat(self, info: WorkerInfo) -> None:
        entry = self._workers.get(info.worker_id)
        if entry is None:
            log.info("worker %s (%s, %s) joined", info.worker_id, info.role, info.model)
            self._warn_on_layout_mismatch(info)
            self._workers[info.worker_id] = _Entry(info, self._clock())
        else:
            entry.info, entry.last_seen, entry.assigned = info, self._clock(), 0

    def _warn_on_layout_mismatch(self, info: WorkerInfo) -> None:
        for other in self._workers.values():
            if other.info.model == info.model and other.info.fingerprint != info.fingerprint:
                log.error("worker %s serves %s with KV fingerprint %s but %s has %s: they cannot exchange KV",
                          info.worker_id, info.model, info.fingerprint, other.info.worker_id, other.info.fingerprint)

    def expire(self) -> None:
        now = self._clock()
        for worker_id, entry in list(self._workers.items()):
            if now - entry.last_seen > self._missed * entry.info.heartbeat_s:
                log.warning("worker %s missed %d heartbeats: dropped", worker_id, self._missed)
                del self._workers[worker_id]
                for notify in list(entry.watchers):
                    notify(WorkerLost(f"worker {worker_id} stopped answering"))

    async def run_expiry(self, period: float = 0.25) -> None:
        while True:
            self.expire()
            await asyncio.sleep(period)

    def models(self) -> list[str]:
        return sorted({e.info.model for e in self._workers.values()})

    def live(self, role: str | None = None) -> list[WorkerInfo]:
        return [e.info for e in self._workers.values() if role is None or e.info.role == role]

    def pick(self, role: str, model: str, fingerprint: str | None = None, generates: bool = False,
             reserve: bool = True) -> WorkerInfo:
        """Choose a live worker by the dispatch policy (among those that run whole requests, if
        `generates`) and count a request against it unless not `reserve`d; raise a typed error
        when none fits."""
        if not self._workers:
            raise ServiceUnavailable("no live workers: the mesh is starting or its workers are down")
        if model not in self.models():
            raise ModelNotFound(f"The model {model!r} does not exist. Available: {', '.join(self.models()) or 'none'}",
                                param="model")
        candidates = [e for e in self._workers.values() if e.info.role == role and e.info.model == model]
        if fingerprint is not None:
            candidates = [e for e in candidates if e.info.fingerprint == fingerprint]
        if generates:
            candidates = [e for e in candidates if e.info.generates]
        if not candidates:
            detail = f" with KV fingerprint {fingerprint}" if fingerprint else ""
            raise ServiceUnavailable(f"no live {role} worker for {model!r}{detail}")
        snapshots = [WorkerSnapshot(e.info.worker_id, e.info.running, e.info.queued_tokens, e.info.capacity,
                                    e.assigned) for e in candidates]
        chosen = self._policy(snapshots, self._rng)
        if chosen is None:
            raise ServiceUnavailable(f"every {role} worker for {model!r} is at capacity")
        if reserve:
            self.reserve(chosen.worker_id)
        return self._workers[chosen.worker_id].info

    def reserve(self, worker_id: str) -> None:
        """Count a request sent to `worker_id` until its next heartbeat says how loaded it is."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.assigned += 1

    @contextmanager
    def watch(self, worker_id: str, notify: Callable[[BaseException], None]):
        """Call `notify(WorkerLost)` if `worker_id` dies while the block runs."""
        entry = self._workers.get(worker_id)
        if entry is None:
            notify(WorkerLost(f"worker {worker_id} is gone"))
            yield
            return
        entry.watchers.add(notify)
        try:
            yield
        finally:
            entry.watchers.discard(notify)
