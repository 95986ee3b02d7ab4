"""The router's queue: requests wait here for a worker with room instead of failing at once.

Bounded in length (`max_waiting`) and in time (`max_wait_s`, and each request's deadline). A
request that could not be served in time is refused up front with `Overloaded` (HTTP 429 with
`Retry-After`): when the queue is full, when its expected wait (the requests ahead of it, at the
rate the queue has been draining) would pass its deadline or `max_wait_s`, or when the queue
policy names it as unable to meet its time-to-first-token target. As room appears, waiters are placed in the
queue policy's order (llmesh.policies.queueing; default: arrival); one that cannot be placed
yet does not block the others (they may need other workers).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from llmesh.errors import AtCapacity, MeshError, Overloaded
from llmesh.policies import QueuePolicy, RequestView
from llmesh.policies.queueing import ServiceTime, fcfs

T = TypeVar("T")
SMOOTHING = 0.2  # of the EMA of the time between two requests leaving the queue


@dataclass(eq=False)
class _Waiter(Generic[T]):
    place: Callable[[], T]  # raises AtCapacity while there is no room
    request: RequestView
    group: Hashable | None  # waiters whose `place` finds room in the same workers (None: its own)
    placed: asyncio.Future[T] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    def __init__(self, max_waiting: int, max_wait_s: float, policy: QueuePolicy | None = None,
                 service_s: ServiceTime = lambda r: 0.0, clock: Callable[[], float] = time.monotonic):
        self.max_waiting, self.max_wait_s = max_waiting, max_wait_s
        self.policy = fcfs() if policy is None else policy
        self.service_s = service_s  # a request's expected time on a worker once placed (for the policy)
        self._clock = clock
        self._waiting: list[_Waiter] = []
        self._left_at: float | None = None  # when a request last left the queue (None: empty since)
        self.interval_s = 0.0  # EMA of the time between two requests leaving a busy queue (0: not measured)

    def __len__(self) -> int:
        return len(self._waiting)

    def expected_wait_s(self, position: int) -> float:
        return (position + 1) * self.interval_s

    def _retry_after_s(self) -> float:
        return max(1.0, math.ceil(self.expected_wait_s(len(self._waiting))))

    async def admit(self, place: Callable[[], T], request: RequestView, group: Hashable | None = None) -> tuple[T, bool]:
        """`place()`'s result, and whether it waited in line for it (it does not if nobody waits and
        `place` finds room). Raises Overloaded when the request cannot be served in time, and any
        other error of `place`. Waiters of one `group` look for room in the same workers: once one
        finds none, the others behind it in the policy's order are not tried until room changes again."""
        if not self._waiting:
            try:
                return place(), False
            except AtCapacity:
                pass
        now = self._clock()
        wait = self.expected_wait_s(len(self._waiting))
        if len(self._waiting) >= self.max_waiting:
            raise Overloaded(f"the router's queue is full ({self.max_waiting} requests waiting)",
                             retry_after_s=self._retry_after_s())
        if now + wait > request.deadline or wait > self.max_wait_s:
            raise Overloaded(f"the {len(self._waiting)} requests ahead would take ~{wait:.1f}s, past "
                             + ("this request's deadline" if now + wait > request.deadline else
                                f"the router's longest wait ({self.max_wait_s:g}s)"),
                             retry_after_s=self._retry_after_s())
        waiter = _Waiter(place, request, group)
        self._waiting.append(waiter)
        if self._left_at is None:
            self._left_at = now
        self._refuse_hopeless(now)
        limit = max(min(request.deadline - now, self.max_wait_s), 0.0)
        try:
            async with asyncio.timeout(limit):
                return await waiter.placed, True
        except TimeoutError:
            raise Overloaded(f"no worker had room within {limit:.1f}s", retry_after_s=self._retry_after_s()) from None
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    def room_changed(self) -> None:
        """A worker may have room now (a heartbeat, a request finished): place whoever fits, in the
        queue policy's order."""
        if not self._waiting:
            return
        now = self._clock()
        self._refuse_hopeless(now)
        by_id = {w.request.request_id: w for w in self._waiting if not w.placed.done()}
        full: set[Hashable] = set()  # groups a waiter found no room for
        for request in self.policy.order(now, [w.request for w in by_id.values()]):
            waiter = by_id[request.request_id]
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
            self._note_departure()

    def _refuse_hopeless(self, now: float) -> None:
        waiting = [w for w in self._waiting if not w.placed.done()]
        refused = self.policy.refused(now, [w.request for w in waiting], self.service_s)
        for waiter in waiting:
            if waiter.request.request_id in refused:
                waiter.placed.set_exception(Overloaded(
                    f"cannot meet its time-to-first-token target behind the requests queued (queue policy "
                    f"{self.policy.name})", retry_after_s=self._retry_after_s()))

    def _note_departure(self) -> None:
        now = self._clock()
        if self._left_at is not None:
            gap = now - self._left_at
            self.interval_s = gap if not self.interval_s else SMOOTHING * gap + (1 - SMOOTHING) * self.interval_s
        self._left_at = now if self._waiting else None
