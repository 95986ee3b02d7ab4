"""A discrete-event simulation of the router in front of N engines, deciding with the production
policy functions (llmesh.policies) over the same snapshot types the live router builds.

Arrivals wait in the router's queue when the dispatch policy places them nowhere (every engine
full, or over the policy's threshold); the queue policy orders the waiters and refuses the
hopeless ones, as `services/router/admission.py` does live. Engines are `SimEngine`s
(sim/engine.py): monolithic ones, or (with `prefill_instances`) a prefill pool whose requests
go on, after their KV transfer, to the decode pool, each placed by the same policies as the
router places them; with `local_prefill_margin_s`, a decode engine runs the whole request when the
prefill queue would answer later and its streams can absorb the stall (llmesh.policies.disagg,
the router's conditional disaggregation); with a `Migration`, placement's Llumnix balancing moves
running requests between decode engines; with a `RoleSwitching`, placement's BanaServe role switching
moves engines between the prefill and decode pools; with a `ModuleMigration`, BanaServe's Algorithm 4-1
moves KV and roles between pairs of overloaded and underloaded devices. Time is simulated: a run of hours takes seconds.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from llmesh.policies import DispatchContext, Policy, PrefixIndex, QueuePolicy, RequestView, WorkerView
from llmesh.policies.banaserve import (
    ModuleMigrationParams,
    RoleBalance,
    RoleSwitchParams,
    pick_role_switch,
    plan_module_migrations,
)
from llmesh.policies.core import kv_blocks, prompt_blocks
from llmesh.policies.disagg import PrefillSite, StreamProgress, prefill_locally, stall_budget
from llmesh.policies.llumnix import migration_pairs, pick_migration
from llmesh.policies.views import since_heartbeat, worker_view
from llmesh.wire.messages import ROLES, RequestProgress, WorkerInfo

from .engine import EngineProfile, Preemption, PrefixCache, SimEngine, SimRequest


@dataclass(frozen=True)
class Migration:
    """Placement's Llumnix load balancing (services/placement, `llmesh.policies.llumnix`): every `interval_s`
    the decode engines with freeness under `source_below` are paired with those over `destination_above`,
    and each pair moves the request `pick_migration` names, its blocks reserved on the destination. Its
    KV is copied while it decodes on (the stages before the last: `copy_block_s` a block of what it held
    when it started), then it moves, paused `downtime_s` (the last stage, Llumnix's near-constant
    downtime). A request that finished, was preempted or was left with no room meanwhile stays."""

    interval_s: float = 0.5  # MESH_PLACEMENT_PERIOD_S
    source_below: float = 10.0  # MESH_PLACEMENT_SOURCE_BELOW
    destination_above: float = 30.0  # MESH_PLACEMENT_DESTINATION_ABOVE
    copy_block_s: float = 0.0
    downtime_s: float = 0.03


@dataclass(frozen=True)
class RoleSwitching:
    """Placement's BanaServe role switching (services/placement, `llmesh.policies.banaserve.pick_role_switch`):
    every `interval_s` the prefill and decode engines' loads are compared, and the engine it names serves the
    other role from then on, every engine being built with both (its heartbeat says so at once, as a live
    worker's). What it holds: a prefill engine's prompts decode where they are once computed (a live worker
    sends them on); a decode engine's streams go to the decode pool with their KV after its next step, as
    placement evacuates them, and those it had not started go back to the router's queue."""

    interval_s: float = 1.0  # MESH_PLACEMENT_PERIOD_S
    params: RoleSwitchParams = RoleSwitchParams()
    # simulate's log of the switches it made: (when, engine, its new role)
    switched: list[tuple[float, str, str]] = field(default_factory=list, compare=False)


@dataclass(frozen=True)
class ModuleMigration:
    """BanaServe's Algorithm 4-1 per device (`llmesh.policies.banaserve.plan_module_migrations`) every
    `interval_s`: its KV moves run as `Migration`'s do (copied at `params.block_s` a block while the request
    decodes on, then paused `params.sync_s`), its role switches as `RoleSwitching`'s."""

    interval_s: float = 1.0
    params: ModuleMigrationParams = ModuleMigrationParams()
    # simulate's logs: (when, engine, its new role), and (when, request, source, destination) of the KV moves
    switched: list[tuple[float, str, str]] = field(default_factory=list, compare=False)
    moved: list[tuple[float, str, str, str]] = field(default_factory=list, compare=False)


def _worker_view(e: SimEngine) -> WorkerView:
    """`e` as its heartbeat would show it, rebuilt only when its state changed (a step, an arrival)."""
    state = (e.steps, e.busy_until, len(e.waiting), len(e.running))
    if e.view_cache is None or e.view_cache[0] != state:
        e.view_cache = (state, _build_view(e))
    return e.view_cache[1]


def _build_view(e: SimEngine) -> WorkerView:
    """Through the heartbeat a live worker would send, and the conversion the router makes of it."""
    p = e.profile
    held = e.requests
    info = WorkerInfo(
        worker_id=e.worker_id,
        role=e.role,
        model=e.model,
        fingerprint="sim",
        max_model_len=p.kv_blocks * p.block_size,
        heartbeat_s=1.0,
        capacity=p.max_seqs,
        running=len(held),
        queued_tokens=sum(r.prompt_tokens - r.prefilled + r.output_tokens - r.generated for r in held),
        generates=e.role == "decode",
        kv_blocks_used=e.blocks_used(),
        kv_blocks_total=p.kv_blocks,
        block_size=p.block_size,
        prefill_tokens_per_s=1 / p.prefill_token_s if p.prefill_token_s else 0.0,
        requests=[RequestProgress.model_validate(r, from_attributes=True) for r in held],
        roles=list(ROLES) if e.switchable else [],
    )
    return worker_view(info)


PREFIX_CACHES = ("none", "local", "global")


def _prefix_caches(
    ids: Sequence[str], mode: str, profile: EngineProfile, block_tokens: int, store_blocks: int
) -> dict[str, PrefixCache | None]:
    """Each engine's prefix cache: none; vLLM's own, in the engine's KV memory ("local"); or the mesh's
    global store, shared, each hit loaded at the KV transfer speed ("global")."""
    if mode == "none":
        return {i: None for i in ids}
    if mode == "local":
        index = PrefixIndex(max(profile.kv_blocks * profile.block_size // block_tokens, 1))
        return {i: PrefixCache(index, i, block_tokens) for i in ids}
    if mode == "global":
        store = PrefixCache(PrefixIndex(store_blocks), "store", block_tokens, profile.kv_transfer_token_s)
        return {i: store for i in ids}
    raise ValueError(f"prefix cache {mode!r}: one of {', '.join(PREFIX_CACHES)}")


def simulate(
    requests: Sequence[SimRequest],
    profile: EngineProfile,
    instances: int,
    policy: Policy,
    queue_policy: QueuePolicy,
    seed: int = 0,
    prefill_instances: int = 0,
    local_prefill_margin_s: float | None = None,
    tpot_slo_s: float = 0.05,
    prefix_cache: str = "none",
    prefix_block_tokens: int = 512,
    store_blocks: int = 1 << 20,
    max_wait_s: float = 30.0,
    heartbeat_s: float = 1.0,
    models: Sequence[str] = ("sim",),
    preemption: Preemption | None = None,
    migration: Migration | None = None,
    heartbeat_views: bool = False,
    role_switching: RoleSwitching | None = None,
    shared_profiles: Mapping[str, EngineProfile] | None = None,
    module_migration: ModuleMigration | None = None,
) -> list[SimRequest]:
    """Run `requests` (fresh, sorted or not) to the end on `instances` engines (decode engines, when
    `prefill_instances` prefill engines come before them); returns them with their timings. A request
    that waits in the router's queue longer than `max_wait_s` is refused, as the router refuses it.
    `models`: the engines of each pool serve them in turn, a static partition (engine i serves
    models[i % len(models)]); a request goes only to an engine of its own model. `preemption`: how the
    engines free KV under pressure (None: they do not; `SimEngine`); `migration`: placement's balancing
    between decode engines (None: none); `role_switching`: placement's moves of engines between the prefill
    and decode pools (None: the pools are fixed); `module_migration`: BanaServe's per-device moves of KV and
    roles instead (None: none). `shared_profiles`: all the engines share one host's cores, and
    a step that starts while another engine is mid-step takes the times of the profile for what that step
    runs ("prefill" or "decode": `SimEngine.shared_profiles`; None: each owns its device).
    `heartbeat_views`: the policies see each engine as the router does (llmesh_router.scheduler: its last
    heartbeat, one every `heartbeat_s`, staggered, plus the requests sent it and finished since) and
    placement as placement does (the heartbeat alone); by default they see every engine's exact state at
    every decision."""
    monolithic = prefill_instances == 0
    pools = [("e", "decode", instances), ("p", "prefill", prefill_instances)]
    ids = [f"{prefix}{i:03d}" for prefix, _, n in pools for i in range(n)]
    caches = _prefix_caches(ids, prefix_cache, profile, prefix_block_tokens, store_blocks)
    engines = [
        SimEngine(
            f"{prefix}{i:03d}",
            profile,
            role=role,
            cache=caches[f"{prefix}{i:03d}"],
            model=models[i % len(models)],
            preemption=preemption,
            switchable=role_switching is not None or module_migration is not None,
        )
        for prefix, role, n in pools
        for i in range(n)
    ]
    by_id = {e.worker_id: e for e in engines}
    if shared_profiles is not None:
        for e in engines:
            e.shared_profiles, e.neighbours = shared_profiles, tuple(n for n in engines if n is not e)
    routed = PrefixIndex() if policy.needs_prefix else None  # what the router sent where (cache_aware)
    rng = random.Random(seed)
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    for r in requests:
        heapq.heappush(events, (r.arrival, next(order), "arrive", r))
    queue: list[SimRequest] = []
    dispatched = {"prefill": 0, "decode": 0}
    beats: dict[str, WorkerView] = {}  # engine -> its last heartbeat's view (heartbeat_views)
    sent: Counter[str] = Counter()  # engine -> requests the router sent it since that heartbeat
    sent_blocks: Counter[str] = Counter()  # ... the KV blocks their prompts need
    released: Counter[str] = Counter()  # ... and those that finished there since
    if heartbeat_views:
        for i, e in enumerate(engines):
            beats[e.worker_id] = _build_view(e)
            heapq.heappush(events, (heartbeat_s * (i + 1) / len(engines), next(order), "beat", e))

    def router_view(e: SimEngine) -> WorkerView:
        """`e` as the router sees it (llmesh_router.scheduler.Scheduler.view)."""
        if not heartbeat_views:
            return _worker_view(e)
        i = e.worker_id
        return since_heartbeat(beats[i], sent[i], released[i], sent_blocks[i])

    def work_left() -> bool:
        return any(r.finished_at is None and not r.refused for r in requests)

    def role_of(r: SimRequest) -> str:
        return "decode" if monolithic or r.first_token_at is not None else "prefill"

    def service_s(view: RequestView) -> float:
        return profile.prefill_s(view.prompt_tokens)

    def start(engine: SimEngine, now: float) -> None:
        if engine.busy_until is None:
            end = engine.start_step(now)
            if end is not None:
                heapq.heappush(events, (end, next(order), "step", engine))

    def refuse_hopeless(now: float, with_views: bool = False) -> dict[str, RequestView]:
        """Refuse whom the queue policy names hopeless or who waited too long; the waiters' views."""
        views = {r.request_id: r.view() for r in queue} if with_views or queue_policy.drop else {}
        refused = queue_policy.refused(now, list(views.values()), service_s)
        refused |= {r.request_id for r in queue if now - r.queued_at > max_wait_s}  # type: ignore[operator]
        for r in [r for r in queue if r.request_id in refused]:
            r.refused = True
            queue.remove(r)
        return views

    def dispatch(now: float) -> None:
        """The router's `room_changed`: place the waiters who fit, in the queue policy's order."""
        if not queue:
            return
        views = refuse_hopeless(now, with_views=True)
        waiting = {r.request_id: r for r in queue}
        held_back: set[tuple[str, str]] = set()  # (role, model) where a request was held back (nothing placed since)
        workers = {e.worker_id: router_view(e) for e in engines}  # refreshed as requests are placed
        for view in queue_policy.order(now, [views[r.request_id] for r in queue], service_s):
            r = waiting[view.request_id]
            role = role_of(r)
            if (role, r.model) in held_back:
                continue
            ctx = DispatchContext(
                now=now,
                rng=rng,
                request=view,
                role=role,  # type: ignore[arg-type]
                workers=tuple(workers.values()),
                generates=monolithic,
                dispatched=dispatched[role],
                cached_blocks=routed.matches(list(workers), r.prefix_hashes) if routed else {},
            )
            chosen = policy.pick(ctx)
            if chosen is None:
                if not policy.declines_by_request:
                    # the same workers would hold back every other request of this role and model (the router's group)
                    held_back.add((role, r.model))
                continue
            held_back.clear()
            if role == "prefill" and local_prefill_margin_s is not None:
                local = policy.pick(replace(ctx, role="decode", generates=True))
                if local is not None and _prefill_locally(
                    view, by_id[chosen.worker_id], by_id[local.worker_id], now, local_prefill_margin_s, tpot_slo_s
                ):
                    chosen = local
            queue.remove(r)
            if routed is not None:
                routed.record(chosen.worker_id, r.prefix_hashes)
            if r.dispatched_at is None:
                r.dispatched_at, r.worker_id = now, chosen.worker_id
            engine = by_id[chosen.worker_id]
            engine.waiting.append(r)
            dispatched[role] += 1
            sent[engine.worker_id] += 1
            sent_blocks[engine.worker_id] += prompt_blocks(r.prompt_tokens, engine.profile.block_size)
            start(engine, now)
            workers[engine.worker_id] = router_view(engine)

    def migrate(now: float) -> None:
        """Placement's period: start the moves Llumnix's pairing names."""
        assert migration is not None
        decode = [beats[e.worker_id] if heartbeat_views else _worker_view(e) for e in engines if e.role == "decode"]
        for source_view, destination_view in migration_pairs(
            decode, migration.source_below, migration.destination_above
        ):
            progress = pick_migration(source_view)
            if progress is not None:
                move(
                    now,
                    progress.request_id,
                    source_view.worker_id,
                    destination_view.worker_id,
                    migration.copy_block_s,
                    migration.downtime_s,
                )

    def move(
        now: float, request_id: str, source_id: str, destination_id: str, copy_block_s: float, downtime_s: float
    ) -> bool:
        """Start moving a running request's KV (blocks reserved on the destination); whether it started."""
        source, destination = by_id[source_id], by_id[destination_id]
        r = next((r for r in source.running if r.request_id == request_id), None)
        if r is None:
            return False
        room = destination.kv_block_limit() - destination.reserved_blocks()
        if kv_blocks(r.kv_tokens + 1, destination.profile.block_size) > room:
            return False
        r.migrating = True
        destination.incoming.append(r)
        copied = now + kv_blocks(r.kv_tokens, destination.profile.block_size) * copy_block_s
        heapq.heappush(events, (copied, next(order), "migrated", (r, source, destination, downtime_s)))
        return True

    def migrated(now: float, r: SimRequest, source: SimEngine, destination: SimEngine, downtime_s: float) -> None:
        """The last stage: `r` moves unless it finished or left the batch meanwhile."""
        destination.incoming.remove(r)
        r.migrating = False
        if r not in source.running or r.finished_at is not None:
            return
        source.running.remove(r)
        destination.running.append(r)
        r.paused_until, r.worker_id = now + downtime_s, destination.worker_id
        r.migrations += 1
        start(destination, now)
        dispatch(now)

    balance = RoleBalance()

    def switch_roles(now: float) -> None:
        """Placement's period: the switch `pick_role_switch` names, if any."""
        nonlocal balance
        assert role_switching is not None
        views = [beats[e.worker_id] if heartbeat_views else _worker_view(e) for e in engines]
        switch, balance = pick_role_switch(views, now, balance, role_switching.params)
        if switch is not None:
            switch_role(now, by_id[switch.worker_id], switch.role)
            role_switching.switched.append((now, switch.worker_id, switch.role))
            dispatch(now)

    def switch_role(now: float, engine: SimEngine, role: str) -> None:
        engine.role, engine.view_cache = role, None
        if role == "prefill":  # the decodes it had not started: placed afresh
            for r in engine.waiting:
                r.queued_at = now
                queue.append(r)
            engine.waiting.clear()
        if heartbeat_views:  # the worker's heartbeat goes out at once
            beats[engine.worker_id] = _build_view(engine)
            sent[engine.worker_id] = sent_blocks[engine.worker_id] = released[engine.worker_id] = 0

    migrating_modules = False

    def migrate_modules(now: float) -> None:
        """Placement's period: the moves Algorithm 4-1 plans, in order."""
        nonlocal migrating_modules
        assert module_migration is not None
        p = module_migration.params
        views = [beats[e.worker_id] if heartbeat_views else _worker_view(e) for e in engines]
        moves, migrating_modules = plan_module_migrations(views, migrating_modules, p)
        for m in moves:
            if m.request_id is None:
                switch_role(now, by_id[m.destination], m.role)
                module_migration.switched.append((now, m.destination, m.role))
            elif move(now, m.request_id, m.source, m.destination, p.block_s, p.sync_s):
                module_migration.moved.append((now, m.request_id, m.source, m.destination))
        if moves:
            dispatch(now)

    if migration is not None:
        heapq.heappush(events, (migration.interval_s, next(order), "migrate", None))
    if role_switching is not None:
        heapq.heappush(events, (role_switching.interval_s, next(order), "switch", None))
    if module_migration is not None:
        heapq.heappush(events, (module_migration.interval_s, next(order), "modules", None))

    # As the router: a request that finds nobody waiting is placed at once if it fits; one that
    # finds a queue joins it. The queue is served when room may have appeared (a request left a
    # worker, and every heartbeat), and its hopeless or expired waiters are refused as they come.
    ticking = False
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind in ("arrive", "kv_ready"):
            item.queued_at = now  # type: ignore[attr-defined]
            queue.append(item)  # type: ignore[arg-type]
            heapq.heappush(events, (now + max_wait_s * (1 + 1e-9), next(order), "wake", None))  # its wait's end
            if len(queue) == 1:
                dispatch(now)
            else:
                refuse_hopeless(now)
        elif kind == "wake":
            refuse_hopeless(now)
        elif kind == "heartbeat":
            ticking = False
            dispatch(now)
        elif kind == "migrate":
            migrate(now)
            if work_left():
                heapq.heappush(events, (now + migration.interval_s, next(order), "migrate", None))  # type: ignore[union-attr]
        elif kind == "switch":
            switch_roles(now)
            if work_left():
                heapq.heappush(events, (now + role_switching.interval_s, next(order), "switch", None))  # type: ignore[union-attr]
        elif kind == "modules":
            migrate_modules(now)
            if work_left():
                heapq.heappush(events, (now + module_migration.interval_s, next(order), "modules", None))  # type: ignore[union-attr]
        elif kind == "migrated":
            migrated(now, *item)  # type: ignore[misc]
        elif kind == "beat":
            beating: SimEngine = item  # type: ignore[assignment]
            beats[beating.worker_id] = _build_view(beating)
            sent[beating.worker_id] = sent_blocks[beating.worker_id] = released[beating.worker_id] = 0
            if work_left():
                heapq.heappush(events, (now + heartbeat_s, next(order), "beat", beating))
        else:
            engine: SimEngine = item  # type: ignore[assignment]
            left = engine.finish_step(now)
            released[engine.worker_id] += len(left)
            for r in left:
                if r.finished_at is None:  # a prefill engine's: on to decode once its KV is there
                    copied = (r.prompt_tokens + r.generated - 1) * profile.kv_transfer_token_s
                    heapq.heappush(events, (now + copied, next(order), "kv_ready", r))
            start(engine, now)
            if left:
                dispatch(now)
        if queue and not ticking:
            heapq.heappush(events, (now + heartbeat_s, next(order), "heartbeat", None))
            ticking = True
    return list(requests)


def _backlog(e: SimEngine) -> int:
    return sum(r.prompt_tokens - r.prefilled for r in e.requests)


def _prefill_locally(
    view: RequestView, prefill: SimEngine, decode: SimEngine, now: float, margin_s: float, tpot_slo_s: float
) -> bool:
    """The router's choice (router.dispatch `_local_prefill_site`), from the engines' exact state."""
    p = decode.profile
    speed = 1 / p.prefill_token_s if p.prefill_token_s else 0.0
    decoding = [r for r in decode.running if r.first_token_at is not None]
    streams = [
        StreamProgress(now - r.first_token_at, r.generated, r.output_tokens - r.generated)  # type: ignore[operator]
        for r in decoding
    ]
    step_s = p.step_s(0, len(decoding), sum(r.prompt_tokens + r.generated for r in decoding)) if decoding else None
    return prefill_locally(
        view.prompt_tokens,
        PrefillSite(_backlog(prefill), speed),
        PrefillSite(_backlog(decode), speed),
        margin_s,
        stall_budget(streams, tpot_slo_s, step_s),
    )


@dataclass(frozen=True)
class Summary:
    requests: int
    completed: int
    refused: int
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    slo_attainment: float  # of all requests, those that met both targets
    goodput_rps: float  # requests meeting both targets per second of the run


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def run_span_s(requests: Sequence[SimRequest]) -> float:
    """From the first arrival to the last completion (1 s when nothing completed)."""
    finished = (r.finished_at for r in requests if r.finished_at is not None)
    return (max(finished, default=0.0) - min((r.arrival for r in requests), default=0.0)) or 1.0


def summarize(requests: Sequence[SimRequest], ttft_slo_s: float, tpot_slo_s: float) -> Summary:
    done = [r for r in requests if r.finished_at is not None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    good = [
        r
        for r in done
        if r.ttft_s <= (r.ttft_slo_s or ttft_slo_s)  # type: ignore[operator]
        and (r.tpot_s is None or r.tpot_s <= (r.tpot_slo_s or tpot_slo_s))
    ]
    span = run_span_s(requests)
    return Summary(
        len(requests),
        len(done),
        sum(r.refused for r in requests),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        percentile(tpots, 0.5),
        percentile(tpots, 0.99),
        len(good) / max(len(requests), 1),
        len(good) / span,
    )
