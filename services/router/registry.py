"""Live workers, learned from heartbeats; dead ones are dropped and whoever watches them is told. And
the models the mesh has: its catalogue (MESH_MODELS) and whatever a live worker serves; and their LoRA
adapters: what the live workers of a model serve (each heartbeat says), or while none is live, its
catalogue entry's `lora_modules`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from llmesh.wire.config import ServedModel, model_roles
from llmesh.wire.errors import ModelNotFound, StreamInterrupted, WorkerLost
from llmesh.wire.messages import LoraAdapter, Role, WorkerInfo

log = logging.getLogger(__name__)


@dataclass
class _Member:
    info: WorkerInfo
    last_seen: float
    watchers: set[Callable[[BaseException], None]] = field(default_factory=set)


MembershipListener = Callable[[str, "WorkerInfo | None"], None]  # (worker id, its heartbeat; None: it left)


class WorkerRegistry:
    """Who is alive: each worker's last heartbeat, and who waits on it. Listeners `subscribe`d are told
    of each heartbeat and of each worker dropped; what is believed about load is theirs
    (llmesh_router.scheduler)."""

    def __init__(
        self,
        missed_heartbeats: int = 3,
        catalogue: Sequence[ServedModel] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.catalogue = {m.name: m for m in catalogue}
        self._workers: dict[str, _Member] = {}
        self._missed = missed_heartbeats
        self._clock = clock
        self._listeners: list[MembershipListener] = []
        self._adapters: dict[str, tuple[str, LoraAdapter]] | None = None  # (`adapters`, until a worker's change)

    def subscribe(self, listener: MembershipListener) -> None:
        self._listeners.append(listener)

    def _tell(self, worker_id: str, info: WorkerInfo | None) -> None:
        for listener in self._listeners:
            listener(worker_id, info)

    def on_heartbeat(self, info: WorkerInfo) -> None:
        member = self._workers.get(info.worker_id)
        if member is None:
            log.info("worker %s (%s, %s) joined", info.worker_id, info.role, info.model)
            if self.catalogue and info.model not in self.catalogue:
                log.warning("worker %s serves %r, which is not in MESH_MODELS", info.worker_id, info.model)
            self._warn_on_layout_mismatch(info)
            self._workers[info.worker_id] = _Member(info, self._clock())
            self._adapters = None
        else:
            if member.info.adapters != info.adapters:
                self._adapters = None
            if (gap := self._clock() - member.last_seen) > 2 * info.heartbeat_s:
                log.info("worker %s: %.1f s since its last heartbeat", info.worker_id, gap)
            member.info, member.last_seen = info, self._clock()
        self._tell(info.worker_id, info)

    def _warn_on_layout_mismatch(self, info: WorkerInfo) -> None:
        for other in self._workers.values():
            if other.info.model == info.model and other.info.fingerprint != info.fingerprint:
                log.error(
                    "worker %s serves %s with KV fingerprint %s but %s has %s: they cannot exchange KV",
                    info.worker_id,
                    info.model,
                    info.fingerprint,
                    other.info.worker_id,
                    other.info.fingerprint,
                )

    def expire(self, late_s: float = 0.0) -> None:
        """Drop the workers silent for `missed_heartbeats` periods. `late_s`: how late this check runs
        (this process was starved of CPU or blocked): that long is credited to every worker, since the
        heartbeats that came meanwhile are still unread, not missed."""
        now = self._clock()
        for worker_id, member in list(self._workers.items()):
            member.last_seen += late_s
            if now - member.last_seen > self._missed * member.info.heartbeat_s:
                log.warning("worker %s missed %d heartbeats: dropped", worker_id, self._missed)
                del self._workers[worker_id]
                self._adapters = None
                self._tell(worker_id, None)
                for notify in list(member.watchers):
                    notify(WorkerLost(f"worker {worker_id} stopped answering"))

    def interrupt_all(self) -> None:
        """This router's bus reconnected: every request in flight may have lost replies; tell each."""
        watchers = [notify for member in self._workers.values() for notify in member.watchers]
        if watchers:
            log.warning("the bus reconnected: %d requests in flight are sent again from what arrived", len(watchers))
        for notify in watchers:
            notify(StreamInterrupted("the bus reconnected while the request was in flight"))

    async def run_expiry(self, period: float = 0.25) -> None:
        while True:
            due = self._clock() + period
            await asyncio.sleep(period)
            self.expire(late_s=max(self._clock() - due, 0.0))

    def heard_from(self, worker_id: str) -> None:
        """`worker_id` just sent a reply: it is alive, whatever its heartbeats (late ones on a busy machine)."""
        member = self._workers.get(worker_id)
        if member is not None:
            member.last_seen = self._clock()

    def get(self, worker_id: str) -> WorkerInfo | None:
        """`worker_id`'s last heartbeat (None: not alive)."""
        member = self._workers.get(worker_id)
        return None if member is None else member.info

    def models(self) -> list[str]:
        """The models the mesh has: the catalogue's, and any a live worker serves."""
        return sorted(self.catalogue.keys() | {m.info.model for m in self._workers.values()})

    def roles(self, model: str) -> tuple[Role, ...]:
        """The roles of the workers that serve `model`; the first runs its prompts."""
        return model_roles(self.catalogue, model)

    def served(self) -> list[str]:
        """The models that live workers of every role they need serve."""
        have = {(m.info.model, m.info.role) for m in self._workers.values()}
        return [model for model in self.models() if all((model, role) in have for role in self.roles(model))]

    def live(self, role: str | None = None) -> list[WorkerInfo]:
        return [m.info for m in self._workers.values() if role is None or m.info.role == role]

    def knows(self, model: str) -> bool:
        """Whether the mesh has `model` (whether or not a worker serves it now)."""
        return model in self.catalogue or any(m.info.model == model for m in self._workers.values())

    def adapters(self) -> dict[str, tuple[str, LoraAdapter]]:
        """The LoRA adapters the mesh serves, by name: (the model they adapt, the adapter)."""
        if self._adapters is None:
            live = {m.info.model for m in self._workers.values()}
            known = {
                adapter.name: (entry.name, adapter)
                for entry in self.catalogue.values()
                if entry.name not in live
                for adapter in entry.lora_modules
            }
            for member in self._workers.values():
                for name, path in member.info.adapters.items():
                    known.setdefault(name, (member.info.model, LoraAdapter(name=name, path=path)))
            self._adapters = known
        return self._adapters

    def resolve(self, name: str) -> tuple[str, LoraAdapter | None]:
        """What a request's `model` names: a model, or a LoRA adapter and the model it adapts; ModelNotFound
        for neither."""
        if self.knows(name):
            return name, None
        if (adapted := self.adapters().get(name)) is not None:
            return adapted
        raise ModelNotFound(
            f"The model {name!r} does not exist. Available: {', '.join(self.models() + sorted(self.adapters()))}",
            param="model",
        )

    def check_known(self, model: str) -> None:
        """Raise ModelNotFound unless the mesh has `model` (`knows`)."""
        if not self.knows(model):
            raise ModelNotFound(
                f"The model {model!r} does not exist. Available: {', '.join(self.models()) or 'none'}", param="model"
            )

    @contextmanager
    def watch(self, worker_id: str, notify: Callable[[BaseException], None]):
        """Call `notify(WorkerLost)` if `worker_id` dies while the block runs."""
        member = self._workers.get(worker_id)
        if member is None:
            notify(WorkerLost(f"worker {worker_id} is gone"))
            yield
            return
        member.watchers.add(notify)
        try:
            yield
        finally:
            member.watchers.discard(notify)
