"""Ascendra's partitioned dispatch (Ikram et al., "Ascendra: Dynamic Request Prioritization for
Efficient LLM Serving", 2025).

The workers form two pools: low-priority (LP) instances run most requests for throughput, and
a few high-priority (HP) instances stay lightly loaded to serve urgent requests at once. A
performance model predicts each request's time to first token on each LP instance (its backlog
of prompts and this one at the instance's measured prefill speed, or never while its KV blocks
would be overcommitted: `WorkerView.ttft_estimate_s`); a request that would miss its
TTFT deadline everywhere in the LP pool is urgent and is offloaded to the HP instance that
answers soonest. An HP instance takes an urgent request only while it holds a ticket: at most
`tickets` prompts in progress at once, which keeps its answers fast. A request that no instance
can serve in time is hopeless: with `drop_hopeless` the policy holds it back, and the queue
policy `edf` (Ascendra's urgency order) refuses it once its deadline cannot be met, rather than
letting it take time from requests that still can; without, it runs best effort on the LP
instance that answers soonest.

Two more of the paper's mechanisms, off by default: `lp_batch_cap` caps an LP instance's batch
(requests held or on their way), so its decode steps stay short and what does not fit waits in the
router's queue, in the queue policy's order (EDF: Ascendra's urgency), where every retry asks again
whether it is urgent (the paper's offload of an LP queue's requests while they wait, not only on
arrival); `idle_ticket` lets an idle HP instance take the next request whatever its urgency (the
paper's tickets, issued by an HP instance with nothing to do).

Pools are fixed by worker id (the last `high_pool_fraction` of the fitting workers, at least one
when there are two or more), so every caller that sees the same workers draws the same line.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmesh.policies.core import DispatchContext, Policy, WorkerView, fits_request, lowest_cost, request_load


def high_pool(ctx: DispatchContext, high_pool_fraction: float) -> set[str]:
    """Ids of the HP instances among the workers that fit the request."""
    ids = sorted(w.worker_id for w in ctx.workers if fits_request(ctx, w))
    if len(ids) < 2 or high_pool_fraction <= 0:
        return set()
    k = min(max(1, round(high_pool_fraction * len(ids))), len(ids) - 1)
    return set(ids[-k:])


def ascendra(
    high_pool_fraction: float = 0.125,
    tickets: float = 2,
    drop_hopeless: float = 1,
    lp_batch_cap: float = 0,
    idle_ticket: float = 0,
) -> Policy:
    """`lp_batch_cap`: the most requests an LP instance holds (0: its capacity); `idle_ticket` (1): an idle
    HP instance takes the next request."""
    if not 0 <= high_pool_fraction < 1:
        raise ValueError(f"ascendra: high_pool_fraction must lie in [0, 1), not {high_pool_fraction}")
    if tickets < 1:
        raise ValueError(f"ascendra: tickets must be >= 1, not {tickets}")
    if lp_batch_cap < 0:
        raise ValueError(f"ascendra: lp_batch_cap must be >= 0, not {lp_batch_cap}")

    def pick(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
        slack = ctx.request.ttft_deadline - ctx.now
        hp = high_pool(ctx, high_pool_fraction)

        def ttft(w: WorkerView) -> float:
            estimate = w.ttft_estimate_s(ctx.request.prompt_tokens)
            return 0.0 if estimate is None else estimate

        if idle_ticket:
            idle = [(w, c) for w, c in scored if w.worker_id in hp and w.running + w.assigned == 0]
            if idle:
                return lowest_cost(ctx, idle)
        low = [
            (w, c)
            for w, c in scored
            if w.worker_id not in hp and (not lp_batch_cap or w.running + w.assigned < lp_batch_cap)
        ]
        in_time = [(w, c) for w, c in low if ttft(w) <= slack]
        if in_time:
            return lowest_cost(ctx, in_time)
        urgent = [
            (w, ttft(w))
            for w, _ in scored
            if w.worker_id in hp and sum(r.prefilling for r in w.requests) + w.assigned < tickets and ttft(w) <= slack
        ]
        if urgent:
            return lowest_cost(ctx, urgent)
        if drop_hopeless or not low:
            return None
        return lowest_cost(ctx, [(w, ttft(w)) for w, _ in low])

    return Policy(
        "ascendra",
        costs=((1.0, request_load),),
        picker=pick,
        declines_by_request=True,
        params={
            "high_pool_fraction": high_pool_fraction,
            "tickets": tickets,
            "drop_hopeless": drop_hopeless,
            "lp_batch_cap": lp_batch_cap,
            "idle_ticket": idle_ticket,
        },
    )
