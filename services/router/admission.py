"""The router's queue: requests wait here for a worker with room instead of failing at once.

Bounded in length (`max_waiting`) and in time (`max_wait_s`, and each request's deadline). A
request that could not be served in time is refused up front with `Overloaded` (HTTP 429 with
`Retry-After`): when the queue is full, when its expected wait (the requests ahead of it, at the
rate the queue has been draining) would pass its deadline or `max_wait_s`, or when the queue
policy names it as unable to meet its time-to-first-token target. As room appears, waiters are placed in the
queue policy's order (llmesh.policies.queueing; default: arrival); one that cannot be placed
yet does not block the others (they may need other workers). The policy orders, and refuses within,
each queue apart (`queue_of`: the queue of a model's requests; Prism's queue per device, shared by the
models on it): a deadline schedule such as Moore-Hodgson's counts only the requests that wait for the
same workers. The queue's length limit and drain rate are the router's, over all of them.

A request past its prompt (its decode, or a decode resumed elsewhere) is committed: its client has
its first token, so it is placed before every other waiter and never refused for waiting; only its
deadline bounds its wait.

A request for a model that no worker serves now (not placed yet, evicted, its workers restarting) is
parked: it waits for one up to its own limit and its deadline, is not refused by the queue's estimates
(they are about requests that have workers), and does not count ahead of anyone; committed or not.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from llmesh.policies import QueuePolicy, RequestView
from llmesh.policies.queueing import ServiceTime, fcfs
from llmesh.wire.errors import AtCapacity, MeshError, Overloaded, ServiceUnavailable, Timeout

T = TypeVar("T")
DRAIN_WINDOW = 64  # departures the queue's drain rate is averaged over (workers free slots in bursts)


@dataclass(eq=False)
class _Waiter(Generic[T]):
    place: Callable[[], T]  # raises AtCapacity while there is no room
    request: RequestView
    group: Hashable | None  # waiters whose `place` finds room in the same workers (None: its own)
    committed: bool  # past its prompt: placed first, never refused for waiting
    parked: bool  # its model has no worker now: waits for one, apart from the queue's estimates
    placed: asyncio.Future[T] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    def __init__(
        self,
        max_waiting: int,
        max_wait_s: float,
        policy: QueuePolicy | None = None,
        service_s: ServiceTime = lambda r: 0.0,
        clock: Callable[[], float] = time.monotonic,
        queue_of: Callable[[str], Hashable] = lambda model: None,
    ):
        self.max_waiting, self.max_wait_s = max_waiting, max_wait_s
        self.policy = fcfs() if policy is None else policy
        self.service_s = service_s  # a request's expected time on a worker once placed (for the policy)
        self.queue_of = queue_of  # model -> the queue its requests are ordered in (default: one for all)
        self._clock = clock
        self._waiting: list[_Waiter] = []
        self._left_at: float | None = None  # when a request last left the queue (None: empty since)
        self._gaps: deque[float] = deque(maxlen=DRAIN_WINDOW)  # between requests leaving the busy queue

    def __len__(self) -> int:
        return len(self._waiting)

    def parked(self) -> Counter[str]:
        """Requests waiting for a worker of their model, by model."""
        return Counter(w.request.model for w in self._waiting if w.parked)

    @property
    def interval_s(self) -> float:
        """Mean time between two requests leaving the busy queue, over its last DRAIN_WINDOW departures
        (0: not measured)."""
        return sum(self._gaps) / len(self._gaps) if self._gaps else 0.0

    def expected_wait_s(self, position: int) -> float:
        return (position + 1) * self.interval_s

    def _uncommitted(self) -> list[_Waiter]:
        """The waiters the queue's estimates and its policy are about."""
        return [w for w in self._waiting if not w.committed and not w.parked]

    def _overloaded(self, why: str, excess_s: float) -> Overloaded:
        """A refusal, with when to come back: once `excess_s` of the queue has drained, and at most
        `max_wait_s` (by then every request waiting now has left the queue), at least a second."""
        retry_after = min(max(1.0, math.ceil(excess_s)), max(1.0, math.ceil(self.max_wait_s)))
        return Overloaded(why, retry_after_s=retry_after)

    async def admit(
        self,
        place: Callable[[], T],
        request: RequestView,
        group: Hashable | None = None,
        *,
        committed: bool = False,
        parked_s: float | None = None,
    ) -> tuple[T, bool]:
        """`place()`'s result, and whether it waited in line for it (it does not if nobody waits and
        `place` finds room). Raises Overloaded when the request cannot be served in time, and any
        other error of `place`. Waiters of one `group` look for room in the same workers: once one
        finds none, the others behind it in the policy's order are not tried until room changes again.
        A `committed` request tries `place` ahead of everyone and waits until its deadline (then
        Timeout), never refused. With `parked_s`, the request's model has no worker now: it waits for
        one up to `parked_s` and its deadline (then ServiceUnavailable)."""
        parked = parked_s is not None
        if committed or all(w.parked for w in self._waiting):  # parked ones hold back no one
            try:
                return place(), False
            except AtCapacity:
                pass
        now = self._clock()
        if parked:
            if len(self._waiting) >= self.max_waiting and not committed:
                raise self._overloaded(f"the router's queue is full ({self.max_waiting} requests waiting)", 1.0)
            limit = max(min(request.deadline - now, parked_s or 0.0), 0.0)
        elif committed:
            limit = max(request.deadline - now, 0.0)
        else:
            ahead = len(self._uncommitted())
            wait = self.expected_wait_s(ahead)
            if ahead >= self.max_waiting:
                raise self._overloaded(
                    f"the router's queue is full ({self.max_waiting} requests waiting)",
                    self.expected_wait_s(ahead - self.max_waiting),
                )
            allowed = min(request.deadline - now, self.max_wait_s)
            if wait > allowed:
                raise self._overloaded(
                    f"the {ahead} requests ahead would take ~{wait:.1f}s, past "
                    + (
                        "this request's deadline"
                        if now + wait > request.deadline
                        else f"the router's longest wait ({self.max_wait_s:g}s)"
                    ),
                    wait - allowed,
                )
            limit = max(allowed, 0.0)
        waiter = _Waiter(place, request, group, committed, parked)
        self._waiting.append(waiter)
        if self._left_at is None and not committed and not parked:
            self._left_at = now
        self._refuse_hopeless(now)
        try:
            async with asyncio.timeout(limit):
                return await waiter.placed, True
        except TimeoutError:
            if parked:
                raise ServiceUnavailable(f"no worker served {request.model!r} within {limit:.1f}s") from None
            if committed:
                raise Timeout(f"no worker had room for it before its deadline ({limit:.1f}s)") from None
            raise self._overloaded(
                f"no worker had room within {limit:.1f}s", self.expected_wait_s(len(self._uncommitted()))
            ) from None
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            if not self._uncommitted():
                self._left_at = None  # idle from here: not a gap between departures

    def room_changed(self) -> None:
        """A worker may have room now (a heartbeat, a request finished): place whoever fits, the
        committed first (by arrival), then the rest in the queue policy's order."""
        if not self._waiting:
            return
        now = self._clock()
        self._refuse_hopeless(now)
        open_ = [w for w in self._waiting if not w.placed.done()]
        by_id = {w.request.request_id: w for w in open_ if not w.committed}
        committed = sorted((w for w in open_ if w.committed), key=lambda w: w.request.arrival)
        full: set[Hashable] = set()  # groups a waiter found no room for
        ordered = [
            r
            for queue in self._queues([w.request for w in by_id.values()])
            for r in self.policy.order(now, queue, self.service_s)
        ]
        for waiter in committed + [by_id[r.request_id] for r in ordered]:
            if waiter.group is not None and waiter.group in full:
                continue
            try:
                waiter.placed.set_result(waiter.place())
            except AtCapacity:
                if waiter.group is not None:
                    full.add(waiter.group)
                continue
            except MeshError as exc:  # e.g. its workers are gone: fail it now, not at its deadline
                waiter.placed.set_exception(exc)
                continue
            self._waiting.remove(waiter)
            if not waiter.committed and not waiter.parked:
                self._note_departure()

    def _refuse_hopeless(self, now: float) -> None:
        waiting = [w for w in self._uncommitted() if not w.placed.done()]
        refused = {
            request_id
            for queue in self._queues([w.request for w in waiting])
            for request_id in self.policy.refused(now, queue, self.service_s)
        }
        for waiter in waiting:
            if waiter.request.request_id in refused:
                waiter.placed.set_exception(
                    self._overloaded(
                        f"cannot meet its time-to-first-token target behind the requests queued (queue policy "
                        f"{self.policy.name})",
                        self.expected_wait_s(len(waiting)),
                    )
                )

    def _queues(self, requests: list[RequestView]) -> list[list[RequestView]]:
        """`requests` by `queue_of` their model, each in arrival order; the queues in a fixed order."""
        of_model: dict[str, Hashable] = {}
        queues: defaultdict[Hashable, list[RequestView]] = defaultdict(list)
        for r in requests:
            if r.model not in of_model:
                of_model[r.model] = self.queue_of(r.model)
            queues[of_model[r.model]].append(r)
        return [queues[key] for key in sorted(queues, key=repr)]

    def _note_departure(self) -> None:
        now = self._clock()
        if self._left_at is not None:
            self._gaps.append(now - self._left_at)
        self._left_at = now if self._uncommitted() else None
