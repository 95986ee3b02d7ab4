"""The placement service's pure decisions: which request moves, the scaling band, and role switching."""

from dataclasses import replace

import pytest

from llmesh.policies import WorkerView
from llmesh.policies.banaserve import (
    ModuleMigrationParams,
    ModuleMove,
    RoleBalance,
    RoleSwitchParams,
    pick_role_switch,
    plan_module_migrations,
    pool_utilisation,
    switchable,
)
from llmesh.policies.llumnix import (
    ScaleHold,
    freeness,
    freeness_with_one_fewer,
    pick_migration,
    scale_decision,
    scaling_advice,
)
from llmesh.policies.views import worker_view
from llmesh.wire.messages import RequestProgress, WorkerInfo


def req(rid, tokens, generated=1, priority=0, migrating=False):
    return RequestProgress(
        request_id=rid, prompt_tokens=tokens, generated=generated, max_tokens=64, priority=priority, migrating=migrating
    )


def w(worker_id, requests=(), *, kv_total=100, role="decode", state="active"):
    return WorkerView(
        worker_id,
        role,
        "m",
        "f",
        capacity=8,
        running=len(requests),
        state=state,
        kv_blocks_total=kv_total,
        block_size=16,
        requests=tuple(requests),
    )


@pytest.mark.parametrize(
    "requests, expected",
    [
        ([], None),
        ([req("a", 100), req("b", 20)], "b"),  # fewest tokens
        ([req("a", 10, generated=50), req("b", 40, generated=1)], "b"),  # prompt and output count alike
        ([req("a", 20, priority=-1), req("b", 900)], "b"),  # the urgent one stays, however small
        ([req("a", 20, priority=0), req("b", 900, priority=5)], "b"),  # the least urgent goes first
        ([req("a", 20, migrating=True), req("b", 900)], "b"),  # already moving
        ([req("a", 20, migrating=True)], None),
        ([req("a", 20, generated=0), req("b", 900)], "b"),  # prompt not computed yet: no KV to hand over
        ([req("b", 30), req("a", 30)], "a"),  # ties by id
    ],
)
def test_pick_migration(requests, expected):
    chosen = pick_migration(w("src", requests))
    assert (chosen.request_id if chosen else None) == expected


BIG = [req("x", 1400)]  # 88 blocks of 16 tokens: F = 12


@pytest.mark.parametrize(
    "workers, expected",
    [
        ([], 0),
        ([w("a", BIG)], 0),  # 12: inside the band [10, 60]
        ([w("a", BIG), w("b", [req("y", 1600)])], 1),  # (12 - 1) / 2 < 10: add an instance
        ([w("a"), w("b")], -1),  # idle, 100 each: one can go
        ([w("a")], 0),  # ... but never the last one
        ([w("a", BIG), w("b", [req("y", 1600)]), w("c")], 0),  # (12 - 1 + 100) / 3
        ([w("a", BIG), w("b", [req("y", 1600)]), w("c", state="draining")], 1),  # a draining one does not count
        ([w("a", BIG), w("b", [req("y", 1600)]), w("c", role="prefill")], 1),  # nor a prefill worker
        ([w("a", BIG), w("b", [req("y", 1600)]), w("c", kv_total=0)], 1),  # nor one that reports no KV blocks
    ],
)
def test_scaling_advice(workers, expected):
    assert scaling_advice(workers, low=10, high=60) == expected


def test_scaling_advice_counts_the_priority_headroom():
    urgent = [w("a", [req("x", 160, priority=-1)]), w("b", [req("y", 160, priority=-1)])]  # F = 89 each
    assert scaling_advice(urgent, low=10, high=60) == -1
    assert scaling_advice(urgent, low=10, high=60, priority_headroom_blocks=85) == 1  # F = 4 each


def test_worker_view_carries_the_heartbeat_over():
    info = WorkerInfo(
        worker_id="d",
        role="decode",
        model="m",
        fingerprint="f",
        max_model_len=2048,
        running=1,
        queued_tokens=7,
        capacity=4,
        heartbeat_s=1.0,
        state="draining",
        kv_blocks_used=3,
        kv_blocks_total=50,
        block_size=16,
        requests=[
            RequestProgress(request_id="r", prompt_tokens=30, generated=2, max_tokens=9, priority=1, migrating=True)
        ],
    )
    view = worker_view(info)
    assert (view.worker_id, view.state, view.kv_blocks_total, view.block_size, view.queued_tokens) == (
        "d",
        "draining",
        50,
        16,
        7,
    )
    assert view.requests == (
        RequestProgress(request_id="r", prompt_tokens=30, generated=2, max_tokens=9, priority=1, migrating=True),
    )


# ---- BanaServe's role switching (Algorithm 4-1) ---------------------------------------------------------------

BOTH = ("prefill", "decode")
PARAMS = RoleSwitchParams(threshold=0.3, hold_s=2.0, cooldown_s=10.0, min_ratio=1.0, switch_cost=0.1, request_cost=0.05)


def u(worker_id, role, running, *, roles=BOTH, state="active", kv_used=0):
    """A worker whose utilisation is running / 8 + kv_used / 100."""
    return WorkerView(
        worker_id,
        role,
        "m",
        "f",
        capacity=8,
        running=running,
        state=state,
        kv_blocks_used=kv_used,
        kv_blocks_total=100,
        block_size=16,
        roles=roles,
    )


BUSY_PREFILL = [u("p1", "prefill", 8), u("p2", "prefill", 8)]  # L_p = 1
IDLE_DECODE = [u("d1", "decode", 2), u("d2", "decode", 1), u("d3", "decode", 1, kv_used=10)]  # L_d ≈ 0.2
HELD = RoleBalance(direction="prefill", imbalanced_since=0.0)  # prefill short of capacity since 0


@pytest.mark.parametrize(
    "workers, now, state, expected",
    [
        ([u("p1", "prefill", 3), u("d1", "decode", 1), u("d2", "decode", 1)], 5.0, RoleBalance(), None),  # 0.25 <= δ
        (BUSY_PREFILL + IDLE_DECODE, 5.0, RoleBalance(), None),  # imbalanced from now on: not held yet
        (BUSY_PREFILL + IDLE_DECODE, 1.9, HELD, None),  # held 1.9 s of 2
        (BUSY_PREFILL + IDLE_DECODE, 2.0, HELD, ("d2", "prefill")),  # held: the least loaded (d3 has KV in use)
        (BUSY_PREFILL + IDLE_DECODE, 5.0, replace(HELD, last_switch_at=-4.0), None),  # 9 s after the last switch
        (BUSY_PREFILL + IDLE_DECODE, 6.0, replace(HELD, last_switch_at=-4.0), ("d2", "prefill")),  # 10 s after
        (BUSY_PREFILL + [u("d1", "decode", 0)], 5.0, HELD, None),  # never the last decode worker
        (BUSY_PREFILL + [u("d1", "decode", 0), u("d2", "decode", 0, state="draining")], 5.0, HELD, None),  # ... active
        (
            BUSY_PREFILL
            + [u("d1", "decode", 1, roles=()), u("d2", "decode", 0, roles=("decode",)), u("d3", "decode", 1)],
            5.0,
            HELD,
            ("d3", "prefill"),
        ),  # only one built with both roles
        (BUSY_PREFILL + [u("d1", "decode", 0, roles=()), u("d2", "decode", 0, roles=())], 5.0, HELD, None),
        (
            [u("p1", "prefill", 1, kv_used=10), u("p2", "prefill", 0), u("d1", "decode", 7), u("d2", "decode", 8)],
            5.0,
            RoleBalance(direction="decode", imbalanced_since=0.0),
            ("p2", "decode"),
        ),  # the other way round
        (BUSY_PREFILL + [u("d1", "decode", 1), u("d2", "decode", 1, kv_used=1)], 5.0, HELD, ("d1", "prefill")),
        (BUSY_PREFILL + [u("d1", "decode", 1), u("d2", "decode", 1)], 5.0, HELD, ("d1", "prefill")),  # tie: by id
        ([u("p1", "prefill", 8)], 5.0, HELD, None),  # no decode pool: nothing to compare
    ],
)
def test_role_switch(workers, now, state, expected):
    switch, _ = pick_role_switch(workers, now, state, PARAMS)
    assert ((switch.worker_id, switch.role) if switch else None) == expected


def test_role_switch_prefers_fewer_requests_on_equal_load():
    workers = BUSY_PREFILL + [u("d1", "decode", 2), replace(u("d2", "decode", 1, kv_used=0), capacity=4)]  # 0.25 each
    assert pick_role_switch(workers, 5.0, HELD, PARAMS)[0].worker_id == "d2"


def test_role_switch_reckoning_and_state():
    # L_p = 1, L_d = (0.25 + 0.125 + 0.125 + 0.1) / 3 = 0.2; d2 (0.125, 1 request) joins the prefill pool:
    # L_p' = 2.125 / 3, L_d' = 0.475 / 2; benefit = 0.8 - (0.7083 - 0.2375) = 0.3292; cost = 0.1 + 0.05
    switch, state = pick_role_switch(BUSY_PREFILL + IDLE_DECODE, 7.0, HELD, PARAMS)
    assert (switch.prefill_load, switch.decode_load) == pytest.approx((1.0, 0.2))
    assert (switch.benefit, switch.cost, switch.ratio) == pytest.approx((0.32917, 0.15, 2.19444), rel=1e-4)
    assert state == RoleBalance(last_switch_at=7.0)  # the next switch waits for a new imbalance, held anew
    assert pick_role_switch(BUSY_PREFILL + IDLE_DECODE, 8.0, state, PARAMS) == (
        None,
        RoleBalance(direction="prefill", imbalanced_since=8.0, last_switch_at=7.0),
    )


@pytest.mark.parametrize(
    "min_ratio, request_cost, switches",
    [
        (2.0, 0.05, True),  # ratio 2.19
        (2.5, 0.05, False),
        (1.0, 0.3, False),  # 0.3292 / (0.1 + 0.3)
        (0.0, 0.3, True),
    ],
)
def test_role_switch_weighs_benefit_against_cost(min_ratio, request_cost, switches):
    params = replace(PARAMS, min_ratio=min_ratio, request_cost=request_cost)
    switch, state = pick_role_switch(BUSY_PREFILL + IDLE_DECODE, 5.0, HELD, params)
    assert (switch is not None) == switches
    assert state == (RoleBalance(last_switch_at=5.0) if switches else HELD)  # declined: the imbalance still counts


def test_role_switch_forgets_an_imbalance_that_ends_or_turns():
    balanced = [u("p1", "prefill", 2), u("d1", "decode", 2), u("d2", "decode", 2)]
    assert pick_role_switch(balanced, 5.0, replace(HELD, last_switch_at=-9.0), PARAMS) == (
        None,
        RoleBalance(last_switch_at=-9.0),
    )
    decode_short = [u("p1", "prefill", 0), u("p2", "prefill", 0), u("d1", "decode", 8)]
    assert pick_role_switch(decode_short, 5.0, HELD, PARAMS) == (
        None,
        RoleBalance(direction="decode", imbalanced_since=5.0),
    )


def test_prefill_backlog_counts_in_the_prefill_pools_load():
    slow = replace(u("p1", "prefill", 1), queued_tokens=3000, prefill_tokens_per_s=1000.0)  # 3 s of prompts
    assert pool_utilisation(slow, backlog_s=1.0) == 3.0
    assert pool_utilisation(slow, backlog_s=6.0) == 0.5
    assert pool_utilisation(slow, backlog_s=0.0) == 0.125  # requests only
    assert pool_utilisation(replace(slow, prefill_tokens_per_s=0.0), backlog_s=1.0) == 0.125  # speed not measured
    assert pool_utilisation(replace(slow, role="decode"), backlog_s=1.0) == 0.125  # decode: its remaining output
    workers = [slow, u("d1", "decode", 1), u("d2", "decode", 1)]  # requests alone: balanced
    assert pick_role_switch(workers, 5.0, HELD, PARAMS)[0].worker_id == "d1"


def test_role_switch_params_are_checked():
    with pytest.raises(ValueError, match="hold_s, request_cost must be >= 0"):
        RoleSwitchParams(hold_s=-1, request_cost=-0.1)


# ---- BanaServe's Algorithm 4-1 per device (`plan_module_migrations`) -------------------------------------------

MODULES = ModuleMigrationParams(start_gap=0.4, stop_gap=0.2, min_ratio=0.5, block_s=0.01, sync_s=0.03, switch_s=1.0)


def dev(worker_id, role, requests=(), *, roles=BOTH, running=None):
    """A device whose U is (running or its requests) / 8 + the requests' KV blocks / 100 (16 tokens a block)."""
    return replace(
        u(worker_id, role, len(requests) if running is None else running, roles=roles),
        kv_blocks_used=sum(r.kv_blocks(16) for r in requests),
        requests=tuple(requests),
    )


def heavy(*ids):
    """Decoding requests of 20 KV blocks each: 0.125 + 0.2 of U apiece; a move costs 20 × 0.01 + 0.03 s."""
    return [req(i, 319) for i in ids]


def moved(moves):
    return [(m.source, m.destination, m.request_id or m.role) for m in moves]


def test_module_migration_moves_kv_until_the_pair_is_within_the_stop_gap():
    # d1: U = 0.5 + 0.8 = 1.3, d2: 0; each move takes 0.325 off d1's peak for 0.23 s (ratio 1.41)
    moves, migrating = plan_module_migrations(
        [dev("d1", "decode", heavy("b", "a", "c", "d")), dev("d2", "decode")], False, MODULES
    )
    assert moves == [
        ModuleMove("d1", "d2", "a", "decode", pytest.approx(0.325), pytest.approx(0.23)),  # ties: by id
        ModuleMove("d1", "d2", "b", "decode", pytest.approx(0.325), pytest.approx(0.23)),
    ]
    assert not migrating  # 0.65 each: balanced


@pytest.mark.parametrize(
    "params, expected, migrating",
    [
        (replace(MODULES, min_ratio=1.5), [], True),  # benefit / cost 1.41 < ρ: the imbalance stands
        (replace(MODULES, block_s=0.05), [], True),  # 1.03 s a move: 0.32 / s
        (replace(MODULES, budget_s=0.3), ["a"], True),  # one move within the budget; 0.65 apart after it
        (replace(MODULES, budget_s=0.46), ["a", "b"], False),
    ],
)
def test_module_migration_weighs_benefit_against_cost_in_seconds(params, expected, migrating):
    devices = [dev("d1", "decode", heavy("a", "b", "c", "d")), dev("d2", "decode")]
    moves, still = plan_module_migrations(devices, False, params)
    assert [m.request_id for m in moves] == expected and still == migrating


def test_module_migration_hysteresis():
    # 0.35 apart: under δ↑ (0.4) nothing starts; once migrating, it goes on down to δ↓ (0.2)
    devices = [dev("d1", "decode", [req("a", 79), req("b", 79)]), dev("d2", "decode")]
    assert plan_module_migrations(devices, False, MODULES) == ([], False)
    moves, migrating = plan_module_migrations(devices, True, MODULES)
    assert moved(moves) == [("d1", "d2", "a")] and not migrating
    one = [dev("d1", "decode", [req("a", 319)]), dev("d2", "decode")]  # 0.325 apart, one request: no move helps
    assert plan_module_migrations(one, True, MODULES) == ([], True)


def test_module_migration_moves_only_decoding_requests_that_fit():
    requests = [req("a", 319, migrating=True), req("b", 319, generated=0), req("c", 319), req("d", 319)]
    small = replace(dev("d2", "decode"), kv_blocks_total=21)  # room for one 20-block request and its next token
    moves, _ = plan_module_migrations([dev("d1", "decode", requests), small], False, MODULES)
    assert moved(moves) == [("d1", "d2", "c")]


def test_module_migration_switches_an_underloaded_device_to_the_overloaded_role():
    # p1: U = 1; a decode device takes half its compute (0.5) for 1 s of switching; d2 keeps the decode pool
    busy, d1, d2 = dev("p1", "prefill", running=8), dev("d1", "decode"), dev("d2", "decode", running=1)
    moves, migrating = plan_module_migrations([busy, d1, d2], False, MODULES)
    assert moves == [ModuleMove("p1", "d1", None, "prefill", pytest.approx(0.5), 1.0)]
    assert migrating  # 0.5 against d2's 0.125: the last decode device cannot go
    moves, _ = plan_module_migrations([busy, replace(d1, roles=()), d2], False, MODULES)
    assert moved(moves) == [("p1", "d2", "prefill")]  # only a device built with both roles
    assert plan_module_migrations([busy, d1, d2], False, replace(MODULES, min_ratio=0.6))[0] == []
    assert plan_module_migrations([busy, replace(d1, state="draining")], False, MODULES)[0] == []


def test_module_migration_switch_then_kv_moves_in_one_loop():
    # d1, the only decode device, is short of memory (U 0.5 + 0.8); p1 switches to decode, judged as taking
    # half of it (benefit 0.65 for 1 s), takes half the compute term at once (d1 1.05, p1 0.25), then one
    # request's KV (d1 0.725, p1 0.575); p2 stays the prefill pool's last
    devices = [dev("d1", "decode", heavy("a", "b", "c", "d")), dev("p1", "prefill"), dev("p2", "prefill")]
    moves, migrating = plan_module_migrations(devices, False, MODULES)
    assert moves[0] == ModuleMove("d1", "p1", None, "decode", pytest.approx(0.65), 1.0)
    assert moved(moves) == [("d1", "p1", "decode"), ("d1", "p1", "a")]
    assert migrating  # d1 0.725 against p2's 0
    assert plan_module_migrations(devices, False, replace(MODULES, min_ratio=0.7)) == ([], True)


def test_module_migration_params_are_checked():
    with pytest.raises(ValueError, match="sync_s must be >= 0"):
        ModuleMigrationParams(sync_s=-1)
    with pytest.raises(ValueError, match="stop_gap"):
        ModuleMigrationParams(start_gap=0.1, stop_gap=0.2)


def test_worker_view_carries_the_roles_over():
    info = WorkerInfo(
        worker_id="d",
        role="decode",
        model="m",
        fingerprint="f",
        max_model_len=2048,
        running=0,
        queued_tokens=0,
        capacity=4,
        heartbeat_s=1.0,
        roles=["prefill", "decode"],
    )
    assert worker_view(info).roles == BOTH and switchable(worker_view(info))
    assert not switchable(worker_view(info.model_copy(update={"roles": []})))


def run_scaling(samples, window_s: float = 10, minimum: int = 1, maximum: int = 3, down_window_s: float = 0):
    """(time, mean freeness or None, instances[, freeness with one fewer]) in order -> the actions taken, with
    their times (band 10-60; with one fewer: as the mean unless given)."""
    hold, acted = ScaleHold(), []
    for now, free, instances, *fewer in samples:
        with_one_fewer = fewer[0] if fewer else free or 0.0
        action, hold, _ = scale_decision(
            free, with_one_fewer, instances, now, hold, window_s, down_window_s, 10, 60, minimum, maximum
        )
        if action:
            acted.append((now, action))
    return acted


def test_scaling_acts_on_the_windows_average_then_watches_a_whole_window_again():
    assert run_scaling([(t, 5.0, 1) for t in range(0, 25)]) == [(10, 1), (21, 1)]


def test_scaling_acts_on_a_low_average_even_when_single_samples_cross_back_over_the_band():
    """At the band's edge the instantaneous freeness flickers around it: a streak never lasts a window,
    the window's average is below the band (the first reading took 78 s to scale up for this)."""
    flicker = [(t, 4.0 if t % 3 else 12.0, 1) for t in range(0, 15)]
    assert run_scaling(flicker) == [(10, 1)]


def test_scaling_holds_inside_the_band_and_while_an_action_settles():
    assert run_scaling([(t, 30.0, 2) for t in range(0, 40)]) == []
    settling = [(t, None if t < 8 else 5.0, 1) for t in range(0, 20)]  # an instance starting until t=8
    assert run_scaling(settling) == [(18, 1)]


def test_scaling_stays_within_its_bounds_and_restores_the_minimum_at_once():
    assert run_scaling([(t, 5.0, 3) for t in range(0, 30)]) == []  # at the maximum
    assert run_scaling([(t, 90.0, 1) for t in range(0, 30)]) == []  # at the minimum
    assert run_scaling([(0, None, 0)], minimum=1) == [(0, 1)]
    assert run_scaling([(t, 90.0, 3) for t in range(0, 25)]) == [(10, -1), (21, -1)]


def test_scaling_down_waits_until_the_instances_left_would_stay_in_the_band():
    """Just after a scale-up the new instance is empty: the mean is over the band while the others are as
    full as when they asked for it (measured: drained 11 s after it joined, then started again cold)."""
    joined = [(t, 70.0, 2, 4.0) for t in range(0, 30)]  # one empty, one nearly full: pooled, one alone is at 4
    assert run_scaling(joined) == []
    emptied = [(t, 70.0, 2, 4.0 if t < 20 else 40.0) for t in range(0, 30)]
    assert run_scaling(emptied) == [(21, -1)]  # the window's average of the projection reaches 10 at t=21


def test_freeness_with_one_fewer_pools_the_others_room_over_every_request():
    busy = replace(w("a", kv_total=24), kv_blocks_used=20, running=5)  # no request list: the blocks in use
    empty = w("b", kv_total=24)
    assert freeness(empty) == 24 and freeness(busy) == 4 / 5
    assert freeness_with_one_fewer([busy, empty], empty) == 4 / 5  # as the busy one is alone
    light = replace(busy, kv_blocks_used=6, running=2)
    assert freeness_with_one_fewer([light, empty], light) == (24 - 6) / 2  # its 2 requests move to the empty one


def test_scaling_down_waits_out_its_own_longer_window_and_a_lull_shorter_than_it_drains_nothing():
    lull = [(t, 90.0 if 10 <= t < 20 else 30.0, 2) for t in range(0, 60)]  # 10 s between bursts
    assert run_scaling(lull, window_s=5, down_window_s=30) == []
    assert run_scaling(lull, window_s=5, down_window_s=5) == [(12, -1), (18, -1)]  # drained within the lull
    quiet = [(t, 90.0, 2) for t in range(0, 40)]
    assert run_scaling(quiet, window_s=5, down_window_s=30) == [(30, -1)]
    assert run_scaling([(t, 5.0, 1) for t in range(0, 8)], window_s=5, down_window_s=30) == [(5, 1)]  # up: at once
