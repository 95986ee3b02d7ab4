"""Least-loaded dispatch: the live worker with the lowest normalised load wins."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSnapshot:
    worker_id: str
    running: int  # requests the worker reported in its last heartbeat
    queued_tokens: int  # tokens of work it reported in flight
    capacity: int  # requests it accepts at once
    assigned: int = 0  # requests this router sent it since that heartbeat

    @property
    def requests(self) -> int:
        return self.running + self.assigned

    @property
    def load(self) -> float:
        return self.requests / max(self.capacity, 1)


def least_loaded(workers: Sequence[WorkerSnapshot], rng: random.Random) -> WorkerSnapshot | None:
    """Lowest load among workers with room; ties (same load and queued tokens) broken by `rng`.

    Returns None when every worker is full or there is none.
    """
    open_ = [w for w in workers if w.requests < w.capacity]
    if not open_:
        return None
    best = min((w.load, w.queued_tokens) for w in open_)
    tied = sorted((w for w in open_ if (w.load, w.queued_tokens) == best), key=lambda w: w.worker_id)
    return tied[0] if len(tied) == 1 else rng.choice(tied)
