"""Live workers, learned from heartbeats; dead ones are dropped and whoever watches them is told."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from llmesh.errors import AtCapacity, ModelNotFound, ServiceUnavailable, StreamInterrupted, WorkerLost
from llmesh.messages import WorkerInfo
from llmesh.policies import DispatchContext, Policy, PrefixIndex, RequestView, WorkerView
from llmesh.policies.baseline import least_loaded
from llmesh.policies.core import Role, fits_request
from llmesh.views import worker_view

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    info: WorkerInfo
    last_seen: float
    assigned: int = 0  # requests sent since its last heartbeat
    released: int = 0  # requests finished since its last heartbeat
    watchers: set[Callable[[BaseException], None]] = field(default_factory=set)
    heartbeat_view: WorkerView | None = None  # what the policies see of `info`, built once per heartbeat
    unreachable: bool = False  # NATS found nothing serving it since its last heartbeat: it takes nothing new

    def view(self, sent_backlog: int = 0) -> WorkerView:
        """What the policies see of this worker: its last heartbeat and what was sent it since (and
        `sent_backlog`, the prompt tokens this router sent it that are not computed yet)."""
        if self.heartbeat_view is None:
            view = worker_view(self.info)
            self.heartbeat_view = replace(view, state="draining") if self.unreachable else view
        if not self.assigned and not self.released and not sent_backlog:
            return self.heartbeat_view
        # A finished request was either sent since the heartbeat or counted in it.
        from_assigned = min(self.released, self.assigned)
        return replace(
            self.heartbeat_view,
            assigned=self.assigned - from_assigned,
            running=max(self.heartbeat_view.running - (self.released - from_assigned), 0),
            sent_backlog=sent_backlog,
        )


class WorkerRegistry:
    def __init__(
        self,
        missed_heartbeats: int = 3,
        policy: Policy | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        max_backlog_s: float | None = None,
    ):
        self._workers: dict[str, _Entry] = {}
        self.max_backlog_s = max_backlog_s  # llmesh.policies.core.has_room
        self.backlog: dict[str, int] = defaultdict(int)  # worker id -> prompt tokens sent it, not yet computed
        self._missed = missed_heartbeats
        self.policy = policy or least_loaded()
        self._rng = random.Random(seed)
        self._clock = clock
        self._dispatched: dict[str, int] = {"prefill": 0, "decode": 0}  # requests sent per role (round-robin's turn)
        self.room_changed: Callable[[], None] = lambda: None  # called when a worker may have room (the queue's)
        self._prefixes = PrefixIndex() if self.policy.needs_prefix else None  # which prompts went where

    def on_heartbeat(self, info: WorkerInfo) -> None:
        entry = self._workers.get(info.worker_id)
        if entry is None:
            log.info("worker %s (%s, %s) joined", info.worker_id, info.role, info.model)
            self._warn_on_layout_mismatch(info)
            self._workers[info.worker_id] = _Entry(info, self._clock())
        else:
            if (gap := self._clock() - entry.last_seen) > 2 * info.heartbeat_s:
                log.info("worker %s: %.1f s since its last heartbeat", info.worker_id, gap)
            entry.info, entry.last_seen, entry.heartbeat_view = info, self._clock(), None
            entry.assigned = entry.released = 0
            entry.unreachable = False
        self.room_changed()

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
        for worker_id, entry in list(self._workers.items()):
            entry.last_seen += late_s
            if now - entry.last_seen > self._missed * entry.info.heartbeat_s:
                log.warning("worker %s missed %d heartbeats: dropped", worker_id, self._missed)
                del self._workers[worker_id]
                if self._prefixes is not None:
                    self._prefixes.forget(worker_id)
                for notify in list(entry.watchers):
                    notify(WorkerLost(f"worker {worker_id} stopped answering"))

    def interrupt_all(self) -> None:
        """This router's bus reconnected: every request in flight may have lost replies; tell each."""
        watchers = [notify for entry in self._workers.values() for notify in entry.watchers]
        if watchers:
            log.warning("the bus reconnected: %d requests in flight are sent again from what arrived", len(watchers))
        for notify in watchers:
            notify(StreamInterrupted("the bus reconnected while the request was in flight"))

    def unreachable(self, worker_id: str) -> None:
        """NATS found nothing serving `worker_id`: send it nothing new until its next heartbeat (a
        dead one sends none and is dropped as usual, failing what it held)."""
        entry = self._workers.get(worker_id)
        if entry is not None and not entry.unreachable:
            log.warning("worker %s serves nothing on its subject: no new requests until it beats again", worker_id)
            entry.unreachable, entry.heartbeat_view = True, None

    def refused_at_capacity(self, worker_id: str) -> None:
        """`worker_id` refused a request as full: it held its capacity then, whatever this router's
        view of it said (requests sent before its heartbeat reached here, another router's). Count it
        full from now on; each request that ends here frees a slot again, as does its next heartbeat."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.heartbeat_view = replace(entry.view(), running=entry.info.capacity, assigned=0)
            entry.assigned, entry.released = 1, 0  # the refused request's reservation, released after this

    def decode_room(self, model: str) -> int | None:
        """Requests the active decode workers of `model` take now, by this router's view of them (None:
        there is none)."""
        views = [
            v
            for v in (e.view() for e in self._workers.values())
            if v.role == "decode" and v.model == model and v.state == "active"
        ]
        return sum(max(v.capacity - v.running - v.assigned, 0) for v in views) if views else None

    async def run_expiry(self, period: float = 0.25) -> None:
        while True:
            due = self._clock() + period
            await asyncio.sleep(period)
            self.expire(late_s=max(self._clock() - due, 0.0))

    def release(self, worker_id: str) -> None:
        """A request `worker_id` held has finished: count its room until the next heartbeat says."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.released += 1
        self.room_changed()

    def heard_from(self, worker_id: str) -> None:
        """`worker_id` just sent a reply: it is alive, whatever its heartbeats (late ones on a busy machine)."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.last_seen = self._clock()

    def models(self) -> list[str]:
        return sorted({e.info.model for e in self._workers.values()})

    def live(self, role: str | None = None) -> list[WorkerInfo]:
        return [e.info for e in self._workers.values() if role is None or e.info.role == role]

    def check_served(self, model: str) -> None:
        """Raise unless a live worker serves `model`."""
        if not self._workers:
            raise ServiceUnavailable("no live workers: the mesh is starting or its workers are down")
        if model not in self.models():
            raise ModelNotFound(
                f"The model {model!r} does not exist. Available: {', '.join(self.models()) or 'none'}", param="model"
            )

    def pick(
        self,
        role: Role,
        request: RequestView,
        fingerprint: str | None = None,
        generates: bool = False,
        reserve: bool = True,
    ) -> WorkerInfo:
        """Choose a live worker for `request` by the dispatch policy (with KV layout `fingerprint`,
        among those that run whole requests if `generates`) and count the request against it unless
        not `reserve`d; raise a typed error when none fits."""
        self.check_served(request.model)
        cached = self._prefixes.matches(list(self._workers), request.prefix_hashes) if self._prefixes else {}
        ctx = DispatchContext(
            now=self._clock(),
            rng=self._rng,
            request=request,
            workers=tuple(e.view(self.backlog.get(w, 0)) for w, e in self._workers.items()),
            role=role,
            fingerprint=fingerprint,
            generates=generates,
            dispatched=self._dispatched[role],
            cached_blocks=cached,
            max_backlog_s=self.max_backlog_s,
        )
        chosen = self.policy.pick(ctx)
        if chosen is None:
            detail = f" with KV fingerprint {fingerprint}" if fingerprint else ""
            if not any(fits_request(ctx, w) for w in ctx.workers):
                raise ServiceUnavailable(f"no live {role} worker for {request.model!r}{detail}")
            raise AtCapacity(
                f"no {role} worker for {request.model!r}{detail} can take the request now "
                f"(policy {self.policy.name}: all at capacity or over its threshold)"
            )
        if reserve:
            self.reserve(chosen.worker_id, request.prompt_tokens if role == "prefill" else 0)
            if self._prefixes is not None:
                self._prefixes.record(chosen.worker_id, request.prefix_hashes)
        return self._workers[chosen.worker_id].info

    def reserve(self, worker_id: str, prompt_tokens: int = 0) -> None:
        """Count a request sent to `worker_id` until its next heartbeat says how loaded it is, and the
        `prompt_tokens` it is to compute in its backlog until `prompt_done`."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.assigned += 1
            self._dispatched[entry.info.role] += 1
        self.backlog[worker_id] += prompt_tokens

    def prompt_done(self, worker_id: str, prompt_tokens: int) -> None:
        """`worker_id` computed (or gave up) a prompt `reserve` counted: out of its backlog."""
        left = self.backlog[worker_id] - prompt_tokens
        if left > 0:
            self.backlog[worker_id] = left
        else:
            self.backlog.pop(worker_id, None)

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
