"""The router's queue: requests wait here for a worker with room instead of failing at once.

Bounded in length (`max_waiting`) and in time (`max_wait_s`, and each request's deadline). A
request that could not be served in time is refused up front with `Overloaded` (HTTP 429 with
`Retry-After`): when the queue is full, or when its expected wait (the requests ahead of it, at
the rate the queue has been draining) would pass its deadline. Waiters are served in arrival
order; a waiter that cannot be placed yet does not block the ones behind it (they may need
other workers).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from llmesh.errors import AtCapacity, MeshError, Overloaded

T = TypeVar("T")
SMOOTHING = 0.2  # of the EMA of the time between two requests leaving the queue


@dataclass(eq=False)
class _Waiter(Generic[T]):
    place: Callable[[], T]  # raises AtCapacity while there is no room
    deadline: float  # monotonic
    placed: asyncio.Future[T] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    def __init__(self, max_waiting: int, max_wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_waiting, self.max_wait_s = max_waiting, max_wait_s
        self._clock = clock
        self._waiting: list[_Waiter] = []
        self._left_at: float | None = None  # when a request last left the queue (None: empty since)
        self.interval_s = 0.0  # EMA of the time between two requests leaving a busy queue (0: not measured)

    def __len__(self) -> int:
        return len(self._waiting)

    def expected_wait_s(self, position: int) -> float:
        return (position + 1) * self.interval_s

    async def admit(self, place: Callable[[], T], deadline: float) -> tuple[T, bool]:
        """`place()`'s result, and whether it waited in line for it (it does not if nobody waits and
        `place` finds room). Raises Overloaded when the request cannot be served in time, and any
        other error of `place`."""
        if not self._waiting:
            try:
                return place(), False
            except AtCapacity:
                pass
        now = self._clock()
        wait = self.expected_wait_s(len(self._waiting))
        retry_after = max(1.0, math.ceil(wait))
        if len(self._waiting) >= self.max_waiting:
            raise Overloaded(f"the router's queue is full ({self.max_waiting} requests waiting)",
                             retry_after_s=retry_after)
        if now + wait > deadline:
            raise Overloaded(f"the {len(self._waiting)} requests ahead would take ~{wait:.1f}s, past this "
                             f"request's deadline", retry_after_s=retry_after)
        waiter = _Waiter(place, deadline)
        self._waiting.append(waiter)
        if self._left_at is None:
            self._left_at = now
        try:
            async with asyncio.timeout(max(min(deadline - now, self.max_wait_s), 0.0)):
                return await waiter.placed, True
        except TimeoutError:
            raise Overloaded(f"no worker had room within {min(deadline - now, self.max_wait_s):.1f}s",
                             retry_after_s=retry_after) from None
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)

    def room_changed(self) -> None:
        """A worker may have room now (a heartbeat, a request finished): place whoever fits, in order."""
        for waiter in list(self._waiting):
            if waiter.placed.done():
                continue
            try:
                waiter.placed.set_result(waiter.place())
            except AtCapacity:
                continue
            except MeshError as exc:  # e.g. its workers are gone: fail it now, not at its deadline
                waiter.placed.set_exception(exc)
                continue
            self._waiting.remove(waiter)
            self._note_departure()

    def _note_departure(self) -> None:
        now = self._clock()
        if self._left_at is not None:
            gap = now - self._left_at
            self.interval_s = gap if not self.interval_s else SMOOTHING * gap + (1 - SMOOTHING) * self.interval_s
        self._left_at = now if self._waiting else None
