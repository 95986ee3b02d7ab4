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
`plan_module_migrations` is Algorithm 4-1 as issue 34 quotes the paper (its text is not reachable here): per
device, not per pool; a loop of moves (a request's KV between decode devices, or a role switch) while a pair
of devices stays apart, with δ↑/δ↓ hysteresis and costs in seconds.
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


# ---- Algorithm 4-1 per device: moves between overloaded and underloaded devices ----------------------------


@dataclass(frozen=True)
class ModuleMigrationParams:
    """Algorithm 4-1's knobs as issue 34 quotes the paper: per-device loads U (0 to 2), a gap δ↑ that starts
    migrating and a gap δ↓ it goes on to, and a move's benefit (the peak U it removes) per second of its cost
    (the KV it transfers, and its synchronisation) of at least ρ."""

    start_gap: float = 0.4  # δ↑: migrating starts once two devices' U differ by more than this
    stop_gap: float = 0.2  # δ↓: ... and goes on, period after period, while two differ by more than this
    min_ratio: float = 0.5  # ρ: a move's benefit per second of its cost, at least this
    block_s: float = 0.0  # one KV block transferred between devices
    sync_s: float = 0.03  # a moved request's pause while its last KV and its state move
    switch_s: float = 1.0  # a role switch's synchronisation, beyond the KV of the requests it hands over
    budget_s: float = 2.0  # one period's moves cost at most this together (the paper's migration time budget)
    backlog_s: float = 1.0  # as `RoleSwitchParams.backlog_s`

    def __post_init__(self) -> None:
        negative = [f.name for f in fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"module migration: {', '.join(negative)} must be >= 0")
        if self.stop_gap > self.start_gap:
            raise ValueError("module migration: stop_gap (δ↓) must not exceed start_gap (δ↑)")


@dataclass(frozen=True)
class ModuleMove:
    """One migration from the overloaded device `source` to the underloaded `destination`: the KV of
    `request_id` and its attention (both decode), or, with no request, `destination` switched to serve
    `role`, `source`'s (layers moved at a whole worker's granularity)."""

    source: str
    destination: str
    request_id: str | None
    role: Role
    benefit: float  # the pair's peak U (the pools' when a switch shifts load to others) removed
    cost_s: float


@dataclass
class _Device:
    view: WorkerView
    role: Role
    compute: float  # U's terms, C/Cmax (`pool_utilisation`'s) ...
    memory: float  # ... and M/Mmax
    free_blocks: int
    switched: bool = False

    @property
    def load(self) -> float:
        return self.compute + self.memory


def plan_module_migrations(
    workers: Sequence[WorkerView], migrating: bool, params: ModuleMigrationParams = ModuleMigrationParams()
) -> tuple[list[ModuleMove], bool]:
    """Algorithm 4-1 over the active `workers` (of one model and KV layout, each on its own device), and
    whether migration goes on next period (the hysteresis state; start: False).

    While a pair of devices differs in U by more than δ (δ↑ to start, δ↓ once migrating), the most
    different pair with an acceptable move takes its best one (the most peak U removed), the loads are
    updated as if it were done, and the loop goes on: a move is acceptable if benefit / cost ≥ ρ and the
    period's costs stay within the budget. Moves: between two decode devices, a request's KV (not one
    migrating or still prefilling; only where it fits); between roles, the underloaded device switches to
    the overloaded one's role if it serves both and is not its pool's last, judged as taking over half the
    overloaded device's U (half its layers, with their KV) while what it held goes to its old pool's others;
    it takes half the compute term at once, and the KV moves that follow in the loop bring the memory
    term over (each device switched once a period). Costs: the KV transferred at `block_s` a block, plus
    `sync_s` a request or `switch_s` a switch."""
    p = params
    devices = {
        w.worker_id: _Device(
            w, w.role, pool_utilisation(w, p.backlog_s) - w.kv_usage, w.kv_usage, w.kv_blocks_total - w.held_kv_blocks
        )
        for w in workers
        if w.state == "active" and w.role in ROLES
    }
    moved: set[str] = set()  # requests moved this period
    moves: list[ModuleMove] = []
    spent = 0.0
    gap = p.stop_gap if migrating else p.start_gap
    while True:
        move = None
        for o, u in _pairs(devices, gap):
            move = _best_move(devices, o, u, moved, p)
            if move is not None and spent + move.cost_s <= p.budget_s:
                break
            move = None
        if move is None:
            break
        _apply(devices, move, moved)
        moves.append(move)
        spent += move.cost_s
        gap = p.stop_gap
    widest = max((a.load - b.load for a in devices.values() for b in devices.values()), default=0.0)
    return moves, widest > p.stop_gap and (migrating or bool(moves) or widest > p.start_gap)


def _pairs(devices: dict[str, _Device], gap: float) -> list[tuple[str, str]]:
    """(overloaded, underloaded) pairs whose U differ by more than `gap`, the widest first (ties: by ids)."""
    pairs = [(do.load - du.load, o, u) for o, do in devices.items() for u, du in devices.items()]
    return [(o, u) for difference, o, u in sorted(pairs, key=lambda t: (-t[0], t[1], t[2])) if difference > gap]


def _best_move(
    devices: dict[str, _Device], o: str, u: str, moved: set[str], p: ModuleMigrationParams
) -> ModuleMove | None:
    """The move from `o` to `u` that removes the most peak U with benefit / cost ≥ ρ (ties: the cheaper)."""
    src, dst = devices[o], devices[u]
    before = max(src.load, dst.load)
    options: list[ModuleMove] = []
    if src.role == dst.role == "decode":
        size = src.view.block_size
        for r in src.view.requests:
            blocks = r.kv_blocks(size) if size else 0
            if r.migrating or r.prefilling or r.request_id in moved or blocks + 1 > dst.free_blocks:
                continue
            benefit = before - max(src.load - _share(src.view, blocks), dst.load + _share(dst.view, blocks))
            options.append(ModuleMove(o, u, r.request_id, "decode", benefit, blocks * p.block_s + p.sync_s))
    elif src.role != dst.role and switchable(dst.view) and not dst.switched:
        others = _pool_of(devices, dst)
        if others:
            half = src.load / 2  # what `dst` can take over: half the layers, and their KV
            spread = dst.load / len(others)  # what `dst` held, taken on by its old pool
            after = max(half, *(d.load + spread for d in others))
            before = max(before, *(d.load for d in others))
            cost = dst.view.held_kv_blocks * p.block_s + p.switch_s
            options.append(ModuleMove(o, u, None, src.role, before - after, cost))
    accepted = [m for m in options if m.benefit > 0 and m.benefit >= p.min_ratio * m.cost_s]
    return min(accepted, key=lambda m: (-m.benefit, m.cost_s, m.request_id or ""), default=None)


def _pool_of(devices: dict[str, _Device], device: _Device) -> list[_Device]:
    """The other devices of `device`'s role: its pool, were it to leave."""
    return [d for d in devices.values() if d.role == device.role and d is not device]


def _terms(w: WorkerView, blocks: int) -> tuple[float, float]:
    """The compute and memory terms of U one request holding `blocks` KV blocks adds to `w`."""
    return 1 / max(w.capacity, 1), blocks / w.kv_blocks_total if w.kv_blocks_total else 0.0


def _share(w: WorkerView, blocks: int) -> float:
    return sum(_terms(w, blocks))


def _apply(devices: dict[str, _Device], move: ModuleMove, moved: set[str]) -> None:
    """The loads and room as if `move` were done."""
    src, dst = devices[move.source], devices[move.destination]
    if move.request_id is not None:
        r = next(r for r in src.view.requests if r.request_id == move.request_id)
        blocks = r.kv_blocks(src.view.block_size) if src.view.block_size else 0
        for d, sign in ((src, -1), (dst, 1)):
            compute, memory = _terms(d.view, blocks)
            d.compute += sign * compute
            d.memory += sign * memory
        src.free_blocks += blocks
        dst.free_blocks -= blocks
        moved.add(move.request_id)
        return
    others = _pool_of(devices, dst)
    for d in others:
        d.compute += dst.compute / len(others)
        d.memory += dst.memory / len(others)
    half = src.compute / 2
    src.compute -= half
    dst.role, dst.compute, dst.memory, dst.switched = move.role, half, 0.0, True
    dst.free_blocks = dst.view.kv_blocks_total
