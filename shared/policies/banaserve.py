"""BanaServe's load-aware dispatch (Algorithm 4-2) and adaptive module migration (Algorithm 4-1).

Each instance's utilisation is U = C/Cmax + M/Mmax: its compute load (requests held or on
their way, against the requests it runs at once) plus its KV memory load (blocks in use,
against its blocks). A request goes to the instance with the lowest U if that is under the
threshold θ; otherwise, as Algorithm 4-2 writes it, to the first instance ordered by (U, queue
length) (`banaserve`), or it waits in the router's queue until one is under θ, where the queue
policy orders the waiters (`banaserve_queue`, this codebase's first reading).

Module migration moves serving capacity between the prefill and decode pools, here a whole worker
at a time: a worker built with both roles (`WorkerView.roles`) is told to serve the other one.
`pick_role_switch` compares the pools' mean utilisations L_p and L_d; once one has exceeded the
other by more than δ for `hold_s`, and not within `cooldown_s` of the last switch, the least loaded
switchable worker of the lighter pool changes sides if the imbalance that removes (the benefit) is
at least ρ times the switch's cost (a fixed cost, plus one per request the worker holds: they
finish in its old role first). The caller keeps the hysteresis state (`RoleBalance`) between calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from llmesh.policies.core import DispatchContext, Policy, Role, WorkerView, lowest_cost_below
from llmesh.wire.messages import ROLES


def utilisation(ctx: DispatchContext, w: WorkerView) -> float:
    """U = C/Cmax + M/Mmax (the memory term is 0 for a worker that does not report its KV blocks)."""
    return w.load + w.kv_usage


def queue_length(w: WorkerView) -> int:
    """The requests waiting on `w`: its engine's queue (`WorkerView.engine_queue`) and those sent it since its
    heartbeat."""
    return len(w.engine_queue[1]) + w.assigned


def _check(name: str, threshold: float) -> None:
    if not 0 < threshold <= 2:
        raise ValueError(f"{name}: threshold must lie in (0, 2], not {threshold}")


def banaserve(threshold: float = 1.6) -> Policy:
    """Algorithm 4-2: the lowest U under `threshold` (0 < θ ≤ 2: both terms are fractions), else the first
    by (U, queue length); the request never waits in the router's queue."""
    _check("banaserve", threshold)
    below = lowest_cost_below(threshold)

    def pick(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
        chosen = below(ctx, scored)
        if chosen is not None or not scored:
            return chosen
        return min(scored, key=lambda wc: (wc[1], queue_length(wc[0]), wc[0].worker_id))[0]

    return Policy("banaserve", costs=((1.0, utilisation),), picker=pick, params={"threshold": threshold})


def banaserve_queue(threshold: float = 1.6) -> Policy:
    """The lowest U under `threshold`, else the request waits in the router's queue until one is."""
    _check("banaserve_queue", threshold)
    return Policy(
        "banaserve_queue",
        costs=((1.0, utilisation),),
        picker=lowest_cost_below(threshold),
        params={"threshold": threshold},
    )


# ---- adaptive module migration: role switching ---------------------------------------------------------------


@dataclass(frozen=True)
class RoleSwitchParams:
    """Algorithm 4-1's knobs; loads, benefits and costs are in U's units (0 to 2 per worker)."""

    threshold: float = 0.3  # δ: |L_p − L_d| above this is an imbalance
    hold_s: float = 3.0  # ... once it has lasted this long in the same direction
    cooldown_s: float = 15.0  # no switch this soon after the last one (anti-oscillation)
    min_ratio: float = 1.0  # ρ: switch only when benefit / cost is at least this
    switch_cost: float = 0.1  # the cost of any switch
    request_cost: float = 0.05  # ... plus this per request the worker holds
    backlog_s: float = 1.0  # a prefill worker with this many seconds of queued prompt work (at its measured
    # speed) has a full compute term, if its requests do not already say more; 0: requests only

    def __post_init__(self) -> None:
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"role switching: {', '.join(negative)} must be >= 0")


@dataclass(frozen=True)
class RoleBalance:
    """The hysteresis state the caller keeps between calls of `pick_role_switch` (start: `RoleBalance()`)."""

    direction: Role | None = None  # the role short of capacity since `imbalanced_since` (None: balanced)
    imbalanced_since: float | None = None
    last_switch_at: float = -math.inf


@dataclass(frozen=True)
class RoleSwitch:
    """Switch `worker_id` to serve `role`, and the reckoning behind it."""

    worker_id: str
    role: Role
    prefill_load: float  # L_p before the switch
    decode_load: float  # L_d
    benefit: float  # |L_p − L_d| minus the same once the worker's U counts in the other pool
    cost: float
    ratio: float  # benefit / cost


def pool_utilisation(w: WorkerView, backlog_s: float) -> float:
    """U, where a prefill worker's compute term is the larger of its request load and its queued prompt
    tokens' work at its measured speed, per `backlog_s` seconds (0, or no speed measured: requests only)."""
    compute = w.load
    if w.role == "prefill" and backlog_s and w.prefill_tokens_per_s:
        compute = max(compute, w.queued_tokens / w.prefill_tokens_per_s / backlog_s)
    return compute + w.kv_usage


def switchable(w: WorkerView) -> bool:
    """Built with both roles: it serves either on command."""
    return set(ROLES) <= set(w.roles)


def pick_role_switch(
    workers: Sequence[WorkerView], now: float, state: RoleBalance, params: RoleSwitchParams = RoleSwitchParams()
) -> tuple[RoleSwitch | None, RoleBalance]:
    """The switch Algorithm 4-1 makes now among the active `workers` (of one model and KV layout), if
    any, and the state to pass next time. L_p and L_d are the pools' mean `pool_utilisation`s; with
    either pool empty nothing is compared. The lighter pool gives up its least loaded switchable worker
    (then the fewest requests, then the first id), never its last one; benefit = |L_p − L_d| − the
    same with that worker's U moved to the other pool; cost = `switch_cost` + `request_cost` per
    request it holds or has on its way."""
    p = params
    pools = {role: [w for w in workers if w.role == role and w.state == "active"] for role in ROLES}
    if not pools["prefill"] or not pools["decode"]:
        return None, replace(state, direction=None, imbalanced_since=None)
    loads = {role: [pool_utilisation(w, p.backlog_s) for w in pool] for role, pool in pools.items()}
    prefill_load, decode_load = (sum(loads[r]) / len(loads[r]) for r in ("prefill", "decode"))
    gap = prefill_load - decode_load
    short: Role | None = "prefill" if gap > p.threshold else "decode" if -gap > p.threshold else None
    if short is None:
        return None, replace(state, direction=None, imbalanced_since=None)
    if short != state.direction:
        state = replace(state, direction=short, imbalanced_since=now)
    assert state.imbalanced_since is not None  # set with `direction`
    if now - state.imbalanced_since < p.hold_s or now - state.last_switch_at < p.cooldown_s:
        return None, state
    donor: Role = "decode" if short == "prefill" else "prefill"
    candidates = [
        (u, w.running + w.assigned, w.worker_id, w) for u, w in zip(loads[donor], pools[donor]) if switchable(w)
    ]
    if len(pools[donor]) < 2 or not candidates:
        return None, state
    u, held, _, worker = min(candidates, key=lambda c: c[:3])
    after = (sum(loads[short]) + u) / (len(loads[short]) + 1) - (sum(loads[donor]) - u) / (len(loads[donor]) - 1)
    benefit = abs(gap) - abs(after)
    cost = p.switch_cost + p.request_cost * held
    ratio = benefit / cost if cost else math.inf
    if benefit <= 0 or ratio < p.min_ratio:
        return None, state
    return (
        RoleSwitch(worker.worker_id, short, prefill_load, decode_load, benefit, cost, ratio),
        RoleBalance(last_switch_at=now),
    )
