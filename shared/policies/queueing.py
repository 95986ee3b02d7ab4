"""Who goes first among the requests waiting for a worker with room, and who cannot make it.

A queue policy orders the waiting requests (the router places them in that order as room
appears; one that does not fit yet does not block the others: out-of-order admission), may put
some after the others for this round (deferred: they stay, and are ordered afresh the next time),
and may name requests that cannot meet their time-to-first-token target however they are ordered,
to be refused at once (HTTP 429) rather than time out. `service_s` is the caller's estimate of
a request's time on a worker once placed (its prompt at the measured prefill speed). Pure
functions, as every policy here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llmesh.policies.core import RequestView

ServiceTime = Callable[[RequestView], float]
INF = float("inf")


@dataclass(frozen=True)
class QueuePolicy:
    name: str
    key: Callable[[float, RequestView], tuple]  # (now, request) -> sort key, smallest first
    drop: Callable[[float, Sequence[RequestView], ServiceTime], set[str]] | None = None  # request ids to refuse
    defer: Callable[[float, Sequence[RequestView], ServiceTime], set[str]] | None = None  # ids put last this round
    needs_prediction: bool = False
    params: dict[str, float] = field(default_factory=dict)

    def order(
        self, now: float, waiting: Sequence[RequestView], service_s: ServiceTime = lambda r: 0.0
    ) -> list[RequestView]:
        later = self.defer(now, waiting, service_s) if self.defer else set()
        return sorted(waiting, key=lambda r: (r.request_id in later, *self.key(now, r), r.arrival, r.request_id))

    def refused(self, now: float, waiting: Sequence[RequestView], service_s: ServiceTime) -> set[str]:
        return self.drop(now, waiting, service_s) if self.drop else set()


def fcfs() -> QueuePolicy:
    """First come, first served."""
    return QueuePolicy("fcfs", key=lambda now, r: ())


def priority_fcfs() -> QueuePolicy:
    """vLLM's priority scheduling: the lowest `priority` first, then arrival."""
    return QueuePolicy("priority", key=lambda now, r: (r.priority,))


def edf(drop_hopeless: float = 1) -> QueuePolicy:
    """Ascendra's urgency order (Ascendra: dynamic request prioritization, 2025): earliest
    TTFT deadline first, so a later request with a tighter target overtakes (out-of-order
    admission); with `drop_hopeless`, a request whose deadline has passed or will pass before it
    could be served even first in line is refused under overload, as Ascendra drops requests that
    cannot meet their SLO."""

    def hopeless(now: float, waiting: Sequence[RequestView], service_s: ServiceTime) -> set[str]:
        return {r.request_id for r in waiting if now + service_s(r) > r.ttft_deadline}

    return QueuePolicy(
        "edf",
        key=lambda now, r: (r.ttft_deadline,),
        drop=hopeless if drop_hopeless else None,
        params={"drop_hopeless": drop_hopeless},
    )


def moore_hodgson(now: float, waiting: Sequence[RequestView], service_s: ServiceTime) -> set[str]:
    """Moore-Hodgson (1968): the most requests that meet their TTFT deadline, served one at a time
    in deadline order; returns the ones that cannot (the fewest such)."""
    kept: list[tuple[float, RequestView]] = []
    finish = now
    late: set[str] = set()
    for r in sorted(waiting, key=lambda r: (r.ttft_deadline, r.arrival, r.request_id)):
        s = service_s(r)
        kept.append((s, r))
        finish += s
        if finish > r.ttft_deadline:
            longest = max(range(len(kept)), key=lambda i: (kept[i][0], kept[i][1].arrival))
            s_out, out = kept.pop(longest)
            finish -= s_out
            late.add(out.request_id)
    return late


def prism() -> QueuePolicy:
    """Prism's Algorithm 2 as written, on the shared queue: deadline order (arrival + TTFT target), adding
    each request's expected run time; the requests Moore-Hodgson drops so that the most others meet their
    deadlines are deferred to the end of this round, not refused (the queue's own limits and a request's
    deadline still refuse it)."""
    return QueuePolicy("prism", key=lambda now, r: (r.ttft_deadline,), defer=moore_hodgson)


def prism_refuse() -> QueuePolicy:
    """Prism's order with Moore-Hodgson's dropped requests refused at once (429) instead of deferred: this
    codebase's first reading of Algorithm 2, kept for comparison."""
    return QueuePolicy("prism-refuse", key=lambda now, r: (r.ttft_deadline,), drop=moore_hodgson)


def slo_odbs(slo_bucket_s: float = 0.05) -> QueuePolicy:
    """UELLM's SLO-aware output-driven scheduling (SLO-ODBS): group by SLO (per-token targets in
    buckets of `slo_bucket_s`, the tightest group first), and within a group the shortest
    predicted output first, so similar lengths run together and short requests do not wait
    behind long ones. No prediction: after the predicted ones of its group."""
    if slo_bucket_s <= 0:
        raise ValueError(f"slo_odbs: slo_bucket_s must be > 0, not {slo_bucket_s}")

    def key(now: float, r: RequestView) -> tuple:
        slo_group = int(r.tpot_slo_s // slo_bucket_s) if r.tpot_slo_s is not None else INF
        return (slo_group, r.predicted_tokens if r.predicted_tokens is not None else INF)

    return QueuePolicy("slo_odbs", key=key, needs_prediction=True, params={"slo_bucket_s": slo_bucket_s})


def fairness() -> QueuePolicy:
    """AdaptiveLLM's anti-starvation order: the highest waiting time / predicted output length
    first (a response ratio: short requests go early, and every wait grows until it goes)."""

    def key(now: float, r: RequestView) -> tuple:
        length = max(r.predicted_tokens or r.max_tokens or 1, 1)
        return (-(now - r.arrival) / length,)

    return QueuePolicy("fairness", key=key, needs_prediction=True)
