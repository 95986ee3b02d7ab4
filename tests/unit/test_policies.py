import random
from dataclasses import replace

import pytest

from llmesh.policies import POLICIES, DispatchContext, RequestView, WorkerView, make_policy
from llmesh.policies.llumnix import freeness, migration_pairs
from llmesh.wire.messages import RequestProgress

REQUEST = RequestView("r", "m", prompt_tokens=100, arrival=0.0, deadline=60.0)


def w(
    worker_id,
    running=0,
    queued=0,
    capacity=4,
    assigned=0,
    *,
    role="decode",
    model="m",
    fingerprint="f",
    state="active",
    generates=False,
    kv_used=0,
    kv_total=0,
    requests=(),
):
    return WorkerView(
        worker_id,
        role,
        model,
        fingerprint,
        capacity,
        running,
        queued,
        assigned,
        state,
        generates,
        kv_used,
        kv_total,
        16,
        0.0,
        tuple(requests),
    )


def ctx(workers, seed=0, dispatched=0, **kw):
    return DispatchContext(
        now=0.0,
        rng=random.Random(seed),
        request=kw.pop("request", REQUEST),
        workers=tuple(workers),
        role=kw.pop("role", "decode"),
        dispatched=dispatched,
        **kw,
    )


def picked(policy, workers, **kw):
    chosen = make_policy(policy).pick(ctx(workers, **kw))
    return chosen.worker_id if chosen else None


@pytest.mark.parametrize(
    "workers, expected",
    [
        ([], None),
        ([w("a", running=4)], None),  # full
        ([w("a", running=2), w("b", running=1)], "b"),
        ([w("a", running=1), w("b", running=0, assigned=2)], "a"),  # router-side assignments count
        ([w("a", running=1, queued=900), w("b", running=1, queued=100)], "b"),  # tokens break load ties
        ([w("a", running=2, capacity=8), w("b", running=1, capacity=2)], "a"),  # load is relative to capacity
        ([w("a", running=4), w("b", running=3)], "b"),
    ],
)
def test_least_loaded(workers, expected):
    assert picked("least_loaded", workers) == expected


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    "workers, kw, expected",
    [
        ([w("a", model="other"), w("b")], {}, "b"),  # another model
        ([w("a", fingerprint="x"), w("b")], {"fingerprint": "f"}, "b"),  # another KV layout
        ([w("a", state="draining"), w("b", running=3)], {}, "b"),  # a draining worker takes nothing new
        (
            [w("a"), w("b", running=3, generates=True)],
            {"generates": True},
            "b",
        ),  # whole requests only where it runs them
        ([w("a", role="prefill"), w("b", running=3)], {}, "b"),  # another role
        ([w("a", running=4), w("b", running=4)], {}, None),  # all full
    ],
)
def test_every_policy_filters_the_same_way(policy, workers, kw, expected):
    assert picked(policy, workers, **kw) == expected


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    "workers, expected",
    [
        ([w("a"), w("b", running=3, capacity=8)], "b"),  # it holds the adapter: preferred over a less loaded one
        ([w("a"), w("b", running=4)], "a"),  # never at the price of a queue: a full holder is passed over
        ([w("a"), w("b", running=3, model="other")], "a"),  # a holder that serves another model is no candidate
    ],
)
def test_a_worker_holding_the_requests_adapter_is_preferred_among_those_with_room(policy, workers, expected):
    holders = [
        replace(worker, loaded_adapters=frozenset({"sql"})) if worker.worker_id == "b" else worker for worker in workers
    ]
    request = replace(REQUEST, adapter="sql")
    assert picked(policy, holders, request=request) == expected
    assert picked("least_loaded", workers, request=request) == "a"  # none holds it: as without an adapter


def prefiller(worker_id, *, speed=1000.0, backlog=0, sent=0, running=0):
    """A prefill worker measured at `speed` tokens/s holding `backlog` prompt tokens (heartbeat) and sent
    `sent` more by the caller's account."""
    held = (RequestProgress(request_id="held", prompt_tokens=backlog, max_tokens=16),) if backlog else ()
    return replace(
        w(worker_id, running=running, role="prefill", requests=held), prefill_tokens_per_s=speed, sent_backlog=sent
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    "workers, bound, expected",
    [
        ([prefiller("a", sent=950)], 1.0, None),  # 950 + 100 tokens at 1000/s: 1.05 s of prompts
        ([prefiller("a", sent=950)], 2.0, "a"),
        ([prefiller("a", sent=950)], None, "a"),  # no bound: slots only
        ([prefiller("a", backlog=950, sent=100)], 1.0, "a"),  # the caller's own account, not the older heartbeat's
        ([prefiller("a", sent=950), prefiller("b", sent=400, running=2)], 1.0, "b"),
        ([prefiller("a", speed=0.0, sent=10_000)], 1.0, "a"),  # speed not measured: no estimate
        ([prefiller("a", speed=10.0)], 1.0, "a"),  # nothing sent it: it takes any prompt
    ],
)
def test_a_prefill_worker_has_room_only_while_its_prompts_fit_the_backlog_bound(policy, workers, bound, expected):
    assert picked(policy, workers, role="prefill", max_backlog_s=bound) == expected


def test_the_backlog_bound_leaves_decode_workers_alone():
    busy = replace(w("d"), prefill_tokens_per_s=1000.0, sent_backlog=5000)
    assert picked("least_loaded", [busy], role="decode", max_backlog_s=1.0) == "d"


def test_round_robin_takes_workers_in_turn():
    workers = [w("b"), w("a"), w("c", running=4)]  # c is full: skipped
    assert [picked("round_robin", workers, dispatched=n) for n in range(4)] == ["a", "b", "a", "b"]


@pytest.mark.parametrize("policy", ["random", "least_loaded", "power_of_two"])
def test_random_choices_follow_the_seed_and_spread(policy):
    workers = [w("a"), w("b"), w("c")]
    picks = [picked(policy, workers, seed=seed) for seed in range(40)]
    assert picks == [picked(policy, workers, seed=seed) for seed in range(40)]
    assert set(picks) == {"a", "b", "c"}


def test_power_of_two_never_picks_the_most_loaded_of_three():
    workers = [w("a", running=0), w("b", running=1), w("c", running=3)]
    picks = {picked("power_of_two", workers, seed=seed) for seed in range(50)}
    assert picks == {"a", "b"}  # c loses every pair it is drawn in


@pytest.mark.parametrize(
    "workers, threshold, expected, queued",
    [
        # U = load + KV usage
        (
            [w("a", running=1, kv_used=90, kv_total=100), w("b", running=2, kv_used=10, kv_total=100)],
            1.6,
            "b",
            "b",
        ),  # 1.15 vs 0.6
        ([w("a", running=1, kv_used=10, kv_total=100), w("b", running=2, kv_used=10, kv_total=100)], 1.6, "a", "a"),
        (
            [w("a", running=3, kv_used=90, kv_total=100), w("b", running=3, kv_used=95, kv_total=100)],
            1.6,
            "a",  # Algorithm 4-2: over θ, the first by (U, queue length)
            None,  # banaserve_queue: all over θ, the request waits in the router's queue
        ),
        ([w("a", running=3, kv_used=90, kv_total=100)], 2.0, "a", "a"),  # 1.65 < 2.0
        ([w("a", running=2)], 1.0, "a", "a"),  # no KV reported: the compute term alone (0.5)
    ],
)
def test_banaserve_dispatches_to_the_lowest_utilisation_under_its_threshold(workers, threshold, expected, queued):
    for name, wanted in (("banaserve", expected), ("banaserve_queue", queued)):
        chosen = make_policy(name, {"threshold": threshold}).pick(ctx(workers))
        assert (chosen.worker_id if chosen else None) == wanted, name


def test_banaserve_over_its_threshold_breaks_ties_by_the_shorter_queue():
    """Both at U = 0.75 + 0.9; a's engine holds a prompt its KV cannot take yet (20 blocks beside 90)."""
    decode = req("d", 1424, generated=16)  # 90 blocks
    a = w("a", running=3, kv_used=90, kv_total=100, requests=[decode, req("p", 320)])
    b = w("b", running=3, kv_used=90, kv_total=100, requests=[decode])
    assert picked("banaserve", [a, b]) == "b" and picked("banaserve", [b, a]) == "b"


def req(rid, tokens, generated=0, priority=0):
    return RequestProgress(request_id=rid, prompt_tokens=tokens, generated=generated, max_tokens=64, priority=priority)


def test_llumnix_freeness():
    # 100 blocks of 16 tokens; two requests fill 2 + 4 blocks: F = (100 - 6) / 2
    a = w("a", running=2, kv_total=100, requests=[req("x", 20), req("y", 50, generated=14)])
    assert freeness(a) == 47.0
    assert freeness(a, priority_headroom_blocks=10) == 47.0  # no high-priority request
    hi = w("b", running=1, kv_total=100, requests=[req("z", 16, priority=-1)])  # vLLM's convention: lower is sooner
    assert freeness(hi) == 99.0 and freeness(hi, priority_headroom_blocks=30) == 69.0
    assert freeness(w("c", state="draining", kv_total=100)) == float("-inf")
    assert freeness(w("d", kv_total=100)) == 100.0  # idle: all of M for a batch of one
    assert freeness(w("e", running=2, kv_used=30, kv_total=100)) == 35.0  # no request list: reported blocks


def test_llumnix_high_priority_requests_share_one_headroom():
    two = w("b", running=2, kv_total=100, requests=[req("z", 16, priority=-1), req("y", 16, priority=-2)])
    assert freeness(two, priority_headroom_blocks=30) == (100 - 2 - 30) / 2


def test_llumnix_head_of_line_counts_only_the_first_waiting_request():
    """100 blocks: a decode holds 50 (784 + 16 tokens), a prompt of 30 blocks fits beside it and runs; the
    next (40 blocks) does not: it is the head of line, and the one after it (10) waits behind it."""
    held = [req("d", 784, generated=16), req("p1", 480), req("p2", 640), req("p3", 160)]
    a = w("a", running=4, kv_total=100, requests=held)
    running, waiting = a.engine_queue
    assert [r.request_id for r in running] == ["d", "p1"] and [r.request_id for r in waiting] == ["p2", "p3"]
    assert freeness(a) == (100 - 50 - 30 - 40 - 10) / 4  # Llumnix's dispatch: every waiting request
    assert freeness(a, head_of_line=True) == (100 - 50 - 30 - 40) / 3  # the paper, its migration: the head alone
    none_wait = w("b", running=2, kv_total=100, requests=held[:2])
    assert none_wait.engine_queue[1] == () and freeness(none_wait, head_of_line=True) == freeness(none_wait)
    assert w("c", running=4, requests=held).engine_queue == (tuple(held), ())  # no KV reported: all run
    # a long queue behind a head of line: only Llumnix's code's dispatch (every waiting request) avoids it
    x = w(
        "x",
        running=7,
        capacity=8,
        kv_total=100,
        requests=[req("d", 944, generated=16), req("h", 800)] + [req("q", 160)] * 5,
    )
    y = w("y", running=2, kv_total=100, requests=[req("e", 1424, generated=16), req("g", 384)])
    assert (freeness(x), freeness(x, head_of_line=True), freeness(y)) == (-60 / 7, -5.0, -7.0)
    assert picked("llumnix", [x, y]) == "y"
    assert make_policy("llumnix", {"head_of_line": 1}).pick(ctx([x, y])).worker_id == "x"


def test_llumnix_dispatches_to_the_freest_even_when_it_runs_more_requests():
    # a: 1 request holding 90 blocks (F = 10); b: 3 small ones (F = (100 - 3) / 3 = 32.3)
    a = w("a", running=1, kv_total=100, requests=[req("x", 1440)])
    b = w("b", running=3, kv_total=100, requests=[req(f"y{i}", 10) for i in range(3)])
    assert picked("least_loaded", [a, b]) == "a"
    assert picked("llumnix", [a, b]) == "b"


def test_llumnix_counts_what_was_sent_since_the_heartbeat():
    """Two workers alike at their heartbeat: the one this router sent three requests (12 blocks) since is
    less free, so a burst between heartbeats spreads instead of going to the one that was freest."""
    a = w("a", running=1, kv_total=100, requests=[req("x", 20)])
    b = replace(a, worker_id="b", assigned=3, assigned_blocks=12)
    assert freeness(a) == 98.0 and freeness(b) == (100 - 2 - 12) / 4
    assert picked("llumnix", [b, a]) == "a"


def test_llumnix_migration_pairs_least_with_most_free():
    big = [req("x", 1400)]  # 88 blocks
    workers = [
        w("busy", running=1, kv_total=100, requests=big),  # F = 12
        w("drain", state="draining", running=1, kv_total=100, requests=[req("y", 10)]),  # F = -inf
        w("idle", kv_total=100),  # F = 100
        w("half", running=1, kv_total=100, requests=[req("z", 800)]),  # F = 50
        w("empty-draining", state="draining", kv_total=100),  # nothing to move, never a destination
    ]
    pairs = migration_pairs(workers, source_below=20, destination_above=40)
    assert [(s.worker_id, d.worker_id) for s, d in pairs] == [("drain", "idle"), ("busy", "half")]
    only_drain = migration_pairs(workers, source_below=-1e9, destination_above=40)  # a draining worker always moves
    assert [(s.worker_id, d.worker_id) for s, d in only_drain] == [("drain", "idle")]
    assert migration_pairs(workers, source_below=20, destination_above=100) == []  # nowhere free enough


@pytest.mark.parametrize(
    "name, params, error",
    [
        ("fastest", None, "unknown policy 'fastest'"),
        ("banaserve", {"threshhold": 1.0}, "no parameter threshhold"),
        ("banaserve", {"threshold": 3.0}, "threshold must lie in"),
        ("llumnix", {"priority_headroom_blocks": -1}, "must be >= 0"),
        ("llumnix", {"head_of_line": 2}, "must be 0 or 1"),
        ("ascendra", {"high_pool_fraction": 1.0}, "must lie in"),
        ("ascendra", {"tickets": 0}, "must be >= 1"),
        ("ascendra", {"lp_batch_cap": -1}, "must be >= 0"),
        ("cache_aware", {"cache_threshold": 2}, "must lie in"),
    ],
)
def test_bad_policy_settings_are_refused_with_the_reason(name, params, error):
    with pytest.raises(ValueError, match=error):
        make_policy(name, params)


def test_router_settings_refuse_an_unknown_policy_at_start(monkeypatch):
    from pydantic import ValidationError

    from llmesh_router.settings import RouterSettings

    monkeypatch.setenv("MESH_POLICY", "banaserve")
    monkeypatch.setenv("MESH_POLICY_PARAMS", '{"threshold": 1.2}')
    assert RouterSettings().dispatch_policy().params == {"threshold": 1.2}
    monkeypatch.setenv("MESH_POLICY", "nope")
    with pytest.raises(ValidationError, match="unknown policy 'nope'"):
        RouterSettings()
    monkeypatch.setenv("MESH_POLICY", "llumnix")
    monkeypatch.setenv("MESH_POLICY_PARAMS", "{}")
    monkeypatch.setenv("MESH_QUEUE_POLICY", "slo_odbs")
    assert RouterSettings().admission_policy().needs_prediction
    monkeypatch.setenv("MESH_QUEUE_POLICY", "lifo")
    with pytest.raises(ValidationError, match="unknown queue policy 'lifo'"):
        RouterSettings()


from llmesh.policies.disagg import PrefillSite, StreamProgress, prefill_locally, stall_budget  # noqa: E402


@pytest.mark.parametrize(
    "prompt, remote, local, margin, expected",
    [
        (512, PrefillSite(0, 1000), PrefillSite(0, 1000), 0.25, False),  # idle prefill worker: disaggregate
        (2000, PrefillSite(0, 1000), PrefillSite(0, 2000), 0.25, False),  # idle, though local measured faster
        (512, PrefillSite(512, 1000), PrefillSite(0, 1000), 0.25, True),  # one prompt queued: 1.02 s vs 0.51 s
        (512, PrefillSite(128, 1000), PrefillSite(0, 1000), 0.25, False),  # 0.64 s vs 0.51 s: within the margin
        (512, PrefillSite(512, 1000), PrefillSite(512, 1000), 0.25, False),  # the decode worker is as busy
        (512, PrefillSite(1024, 1000), PrefillSite(0, 300), 0.25, False),  # 1.54 s vs a slower local 1.71 s
        (512, PrefillSite(2048, 1000), PrefillSite(0, 0), 0.25, True),  # unmeasured local: the remote's speed
        (512, PrefillSite(4096, 0), PrefillSite(0, 0), 0.25, False),  # nothing measured yet
        (512, PrefillSite(4096, 1000), PrefillSite(0, 1000), None, False),  # placement off
    ],
)
def test_prefill_placement(prompt, remote, local, margin, expected):
    assert prefill_locally(prompt, remote, local, margin) is expected


@pytest.mark.parametrize(
    "prompt, local_backlog, expected",
    [
        (512, 0, True),  # 0.51 s of stall: within 0.6 s
        (1200, 0, False),  # a long prompt would stall the decode streams 1.2 s: it waits for the prefill queue
        (512, 256, False),  # 0.77 s with the prompt already queued there
    ],
)
def test_prefill_placement_bounds_the_decode_stall(prompt, local_backlog, expected):
    remote, local = PrefillSite(8192, 1000), PrefillSite(local_backlog, 1000)
    assert prefill_locally(prompt, remote, local, 0.25, max_stall_s=0.6) is expected


@pytest.mark.parametrize(
    "streams, step_s, expected",
    [
        ([], None, float("inf")),  # nothing decoding: nothing to stall
        ([StreamProgress(0.6, 21, 43)], None, 1.26),  # 30 ms/token so far, 64 in all: 3.15 s allowed, 1.89 s planned
        ([StreamProgress(0.6, 21, 43)], 0.02, 1.69),  # at the worker's 20 ms steps: 0.6 + 0.86 s planned
        ([StreamProgress(0.3, 11, 0)], None, 0.2),  # unknown length: as if it ended now (10 gaps, 0.5 s allowed)
        ([StreamProgress(1.2, 21, 43)], None, float("inf")),  # 60 ms/token: past the target, a stall costs nothing
        ([StreamProgress(1.2, 21, 43)], 0.02, 1.09),  # ... unless 20 ms steps bring it in: 3.15 - 1.2 - 0.86
        ([StreamProgress(0.6, 21, 43), StreamProgress(0.0, 1, 63)], None, 1.26),  # no pace yet: the others' (30 ms)
        ([StreamProgress(0.6, 21, 43), StreamProgress(0.8, 21, 3)], None, 0.23),  # the tightest decides (1.15-0.8-0.12)
        ([StreamProgress(0.6, 21, 43), StreamProgress(1.2, 21, 3)], None, 1.26),  # a lost stream does not decide
        ([StreamProgress(0.0, 1, 0)], None, float("inf")),  # one token, no more known: no per-token time to keep
    ],
)
def test_stall_budget_keeps_every_stream_that_can_within_its_tpot(streams, step_s, expected):
    assert stall_budget(streams, tpot_slo_s=0.05, step_s=step_s) == pytest.approx(expected)


# ---- queue policies ------------------------------------------------------------------------------------------

from llmesh.policies import QUEUE_POLICIES, make_queue_policy  # noqa: E402
from llmesh.policies.queueing import moore_hodgson  # noqa: E402


def q(rid, arrival=0.0, ttft=None, tpot=None, predicted=None, priority=0, max_tokens=None, prompt=100):
    return RequestView(
        rid,
        "m",
        prompt_tokens=prompt,
        arrival=arrival,
        deadline=1e9,
        max_tokens=max_tokens,
        predicted_tokens=predicted,
        ttft_slo_s=ttft,
        tpot_slo_s=tpot,
        priority=priority,
    )


@pytest.mark.parametrize(
    "policy, params, waiting, now, expected",
    [
        ("fcfs", None, [q("b", 2), q("a", 1), q("c", 3)], 5, ["a", "b", "c"]),
        ("priority", None, [q("b", 1, priority=0), q("a", 2, priority=-1), q("c", 0, priority=3)], 5, ["a", "b", "c"]),
        # EDF on TTFT deadlines: c arrived last but is due first (3 + 1); no target: its overall deadline (last)
        (
            "edf",
            {"drop_hopeless": 0},
            [q("a", 0, ttft=10), q("b", 1, ttft=5), q("c", 3, ttft=1), q("z", 0)],
            3.5,
            ["c", "b", "a", "z"],
        ),
        # SLO-ODBS: the tighter per-token group first (20-40 ms before 50-100 ms), shortest predicted first within it
        (
            "slo_odbs",
            {"slo_bucket_s": 0.05},
            [
                q("a", 0, tpot=0.08, predicted=10),
                q("b", 1, tpot=0.03, predicted=500),
                q("c", 2, tpot=0.04, predicted=50),
                q("d", 3, tpot=0.03),
            ],
            5,
            ["c", "b", "d", "a"],
        ),
        # fairness: waiting time / predicted length: a 10 s / 100 = 0.1, b 2 s / 10 = 0.2, c 9 s / 300 = 0.03
        (
            "fairness",
            None,
            [q("a", 0, predicted=100), q("b", 8, predicted=10), q("c", 1, predicted=300)],
            10,
            ["b", "a", "c"],
        ),
    ],
)
def test_queue_orders(policy, params, waiting, now, expected):
    assert [r.request_id for r in make_queue_policy(policy, params).order(now, waiting)] == expected


def test_moore_hodgson_keeps_the_most_requests_on_time():
    """Hand-computed: service 4, 3, 2, 6, 5 s, due 8, 9, 10, 11, 13 s from now. In deadline order
    the fourth ends at 15 > 11 (drop the longest so far: j4), the fifth at 14 > 13 (drop j5)."""
    service = {"j1": 4, "j2": 3, "j3": 2, "j4": 6, "j5": 5}
    due = {"j1": 8, "j2": 9, "j3": 10, "j4": 11, "j5": 13}
    waiting = [q(j, arrival=0.0, ttft=due[j]) for j in service]
    assert moore_hodgson(0.0, waiting, lambda r: service[r.request_id]) == {"j4", "j5"}
    assert make_queue_policy("prism-refuse").refused(0.0, waiting, lambda r: service[r.request_id]) == {"j4", "j5"}
    as_written = make_queue_policy("prism")  # Algorithm 2: deferred to the end of the round, not refused
    assert as_written.refused(0.0, waiting, lambda r: service[r.request_id]) == set()
    # a, the earliest due, cannot make it and would make b late: it goes after b and c this round
    late = {"a": 10, "b": 1, "c": 1}
    waiting = [q("a", arrival=0.0, ttft=5), q("b", arrival=0.0, ttft=6), q("c", arrival=0.0, ttft=20)]
    ordered = as_written.order(0.0, waiting, lambda r: late[r.request_id])
    assert [r.request_id for r in ordered] == ["b", "c", "a"]
    assert [r.request_id for r in as_written.order(0.0, waiting)] == ["a", "b", "c"]  # no run times: deadline order
    assert moore_hodgson(0.0, waiting, lambda r: 1.0) == set()  # all fit


def test_moore_hodgson_is_optimal_against_brute_force():
    import itertools

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 7)
        service = [rng.randint(1, 5) for _ in range(n)]
        waiting = [q(f"r{i}", arrival=0.0, ttft=rng.randint(1, 15)) for i in range(n)]
        dropped = moore_hodgson(0.0, waiting, lambda r: service[int(r.request_id[1:])])

        def feasible(kept):  # deadline order is optimal for a fixed set on one server
            t = 0
            for r in sorted(kept, key=lambda r: r.ttft_slo_s):
                t += service[int(r.request_id[1:])]
                if t > r.ttft_slo_s:
                    return False
            return True

        best = max(k for k in range(n + 1) if any(feasible(c) for c in itertools.combinations(waiting, k)))
        assert n - len(dropped) == best
        assert feasible([r for r in waiting if r.request_id not in dropped])


def test_edf_refuses_only_what_cannot_make_it_even_first():
    waiting = [q("late", arrival=0, ttft=2), q("fine", arrival=0, ttft=10)]
    assert make_queue_policy("edf").refused(1.5, waiting, lambda r: 1.0) == {"late"}
    assert make_queue_policy("edf", {"drop_hopeless": 0}).refused(1.5, waiting, lambda r: 1.0) == set()


def test_every_queue_policy_is_deterministic_and_total():
    waiting = [
        q(
            f"r{i}",
            arrival=i % 3,
            ttft=5 + i % 4,
            tpot=0.02 * (1 + i % 3),
            predicted=(i * 37) % 200 or None,
            priority=i % 2,
        )
        for i in range(12)
    ]
    for name in QUEUE_POLICIES:
        policy = make_queue_policy(name)
        first = [r.request_id for r in policy.order(4.0, waiting)]
        assert sorted(first) == sorted(r.request_id for r in waiting)
        assert first == [r.request_id for r in policy.order(4.0, list(reversed(waiting)))]


# ---- prefix affinity -----------------------------------------------------------------------------------------


from llmesh.policies import PrefixIndex  # noqa: E402


def test_prefix_index_matches_leading_blocks_and_forgets_the_least_recent():
    index = PrefixIndex(capacity_blocks=4)
    index.record("a", [1, 2, 3])
    assert index.matched("a", [1, 2, 9, 3]) == 2 and index.matched("a", [9, 1]) == 0 and index.matched("b", [1]) == 0
    index.record("a", [1, 7, 8])  # 5 blocks: 2, the least recent, goes
    assert index.matched("a", [1, 2]) == 1 and index.matched("a", [1, 7, 8]) == 3
    assert index.matches(["a", "b"], [1, 7]) == {"a": 2, "b": 0} and index.matches(["a"], []) == {}


def prefix_ctx(workers, cached, blocks=4):
    return replace(ctx(workers), request=replace(REQUEST, prefix_hashes=tuple(range(blocks))), cached_blocks=cached)


@pytest.mark.parametrize(
    "workers, cached, expected",
    [
        ([w("a", running=2), w("b", running=0)], {"a": 4}, "a"),  # the whole prefix on a: there, though busier
        ([w("a", running=2), w("b", running=0)], {"a": 2}, "b"),  # half is not more than the 0.5 threshold
        ([w("a", running=2), w("b", running=1)], {"a": 3, "b": 4}, "b"),  # the longest match
        ([w("a", running=2), w("b", running=0)], {}, "b"),  # nothing cached: least loaded
        ([w("a", running=40, capacity=64), w("b", running=2, capacity=64)], {"a": 4}, "b"),  # imbalanced: least loaded
        ([w("a", running=4), w("b", running=0)], {"a": 4}, "b"),  # a is full
    ],
)
def test_cache_aware_follows_the_prefix_while_load_is_balanced(workers, cached, expected):
    assert make_policy("cache_aware").pick(prefix_ctx(workers, cached)).worker_id == expected


# ---- Ascendra ------------------------------------------------------------------------------------------------


def fast(worker, backlog_prompts=(), speed=1000.0):
    """`worker` measured at `speed` prompt tokens/s, holding prompts not yet computed."""
    held = tuple(
        RequestProgress(request_id=f"{worker.worker_id}-{i}", prompt_tokens=n, max_tokens=64)
        for i, n in enumerate(backlog_prompts)
    )
    return replace(
        worker, prefill_tokens_per_s=speed, requests=worker.requests + held, running=worker.running + len(held)
    )


def urgent_ctx(workers, ttft_s, now=0.0):
    request = replace(REQUEST, ttft_slo_s=ttft_s)  # 100-token prompt
    return replace(ctx(workers), request=request, now=now)


@pytest.mark.parametrize(
    "workers, ttft_s, params, expected",
    [
        # a, b low-priority; c (last by id) high-priority. A 100-token prompt at 1000 tokens/s: 0.1 s alone.
        ([fast(w("a", capacity=8)), fast(w("b", capacity=8), [500]), fast(w("c", capacity=8))], 1.0, {}, "a"),
        # both in time (0.9 s, 0.7 s): the less loaded (a holds 1 request, b 2)
        (
            [fast(w("a", capacity=8), [800]), fast(w("b", capacity=8), [300, 300]), fast(w("c", capacity=8))],
            1.0,
            {},
            "a",
        ),
        # a is less loaded but its KV (10 blocks of 16) would be overcommitted: it would wait, b answers in time
        (
            [
                fast(w("a", capacity=8, kv_total=10), [100]),
                fast(w("b", capacity=8), [300, 300]),
                fast(w("c", capacity=8)),
            ],
            1.0,
            {},
            "b",
        ),
        # no LP instance answers in 0.5 s: offloaded to the HP instance
        (
            [fast(w("a", capacity=8), [800]), fast(w("b", capacity=8), [900, 900]), fast(w("c", capacity=8))],
            0.5,
            {},
            "c",
        ),
        (
            [fast(w("a", capacity=8), [800]), fast(w("b", capacity=8), [900]), fast(w("c", capacity=8), [50, 50])],
            0.5,
            {},
            None,
        ),  # the HP instance has no ticket left (2 prompts in progress): held back
        (
            [fast(w("a", capacity=8), [800]), fast(w("b", capacity=8), [900]), fast(w("c", capacity=8), [50, 50])],
            0.5,
            {"tickets": 3},
            "c",
        ),
        (
            [fast(w("a", capacity=8), [800]), fast(w("b", capacity=8), [900]), fast(w("c", capacity=8), [600])],
            0.5,
            {},
            None,
        ),  # hopeless everywhere: held back for the queue to refuse
        (
            [fast(w("a", capacity=8), [800]), fast(w("b", capacity=8), [900]), fast(w("c", capacity=8), [600])],
            0.5,
            {"drop_hopeless": 0},
            "a",
        ),  # ... or best effort where it answers soonest
        ([fast(w("a", capacity=8), [800]), fast(w("b", capacity=8))], 0.05, {"high_pool_fraction": 0}, None),
        # the LP batch cap: a holds 1 request, b 2. With a cap of 2, a takes it; with 1, no LP instance has room,
        # so it is offloaded to the HP instance while that has a ticket, else it waits in the router's queue
        (
            [fast(w("a", capacity=8), [100]), fast(w("b", 1, capacity=8), [50]), fast(w("c", capacity=8))],
            1.0,
            {"lp_batch_cap": 2},
            "a",
        ),
        (
            [fast(w("a", capacity=8), [100]), fast(w("b", 1, capacity=8), [50]), fast(w("c", capacity=8))],
            1.0,
            {"lp_batch_cap": 1},
            "c",
        ),
        (
            [fast(w("a", capacity=8), [100]), fast(w("b", 1, capacity=8), [50]), fast(w("c", capacity=8), [50, 50])],
            1.0,
            {"lp_batch_cap": 1},
            None,
        ),
        # an idle HP instance's ticket: the next request goes there, urgent or not
        ([fast(w("a", capacity=8)), fast(w("b", capacity=8)), fast(w("c", capacity=8))], 1.0, {"idle_ticket": 1}, "c"),
        (
            [fast(w("a", capacity=8)), fast(w("b", capacity=8), [300]), fast(w("c", 1, capacity=8), [50])],
            1.0,
            {"idle_ticket": 1},
            "a",  # c is busy: no ticket
        ),
    ],
)
def test_ascendra_offloads_what_the_low_priority_pool_would_serve_late(workers, ttft_s, params, expected):
    chosen = make_policy("ascendra", params).pick(urgent_ctx(workers, ttft_s))
    assert (chosen.worker_id if chosen else None) == expected


def test_ascendra_pools_are_drawn_by_worker_id():
    from llmesh.policies.ascendra import high_pool

    workers = [w(i) for i in "dacbhgfe"]
    assert high_pool(ctx(workers), 0.25) == {"g", "h"} and high_pool(ctx(workers[:1]), 0.25) == set()
    assert high_pool(ctx(workers[:2]), 0.9) == {"d"}  # never the whole pool


def test_llumnix_can_hold_requests_in_the_queue_once_kv_would_be_overcommitted():
    # a: F = (100 - 120) / 2 < 0 (its waiting prompts' demand counts); b: F = (100 - 90) / 1 = 10
    a = w("a", running=2, kv_total=100, requests=[req("x", 960), req("y", 960)])
    b = w("b", running=1, kv_total=100, requests=[req("z", 1440)])
    assert picked("llumnix", [a, b]) == "b"
    held = make_policy("llumnix", {"queue_below": 0})
    assert held.pick(ctx([a, b])).worker_id == "b" and held.pick(ctx([a])) is None
    assert make_policy("llumnix", {"queue_below": 20}).pick(ctx([a, b])) is None


def test_a_running_requests_remaining_output_uses_the_best_estimate_at_hand():
    """The refined estimate (made `generated - remaining_at` tokens ago) over the prompt-only one over
    the budget, never past the budget nor below one token."""
    budget_only = RequestProgress(request_id="r", prompt_tokens=100, generated=40, max_tokens=500)
    assert budget_only.expected_remaining == 460
    prompt_only = RequestProgress(
        request_id="r", prompt_tokens=100, generated=40, max_tokens=500, predicted_tokens=140.0
    )
    assert prompt_only.expected_remaining == 100
    refined = RequestProgress(
        request_id="r",
        prompt_tokens=100,
        generated=40,
        max_tokens=500,
        predicted_tokens=140.0,
        predicted_remaining=300.0,
        remaining_at=32,
    )
    assert refined.expected_remaining == 292
    assert (
        RequestProgress(
            request_id="r", prompt_tokens=100, generated=40, max_tokens=500, predicted_tokens=10.0
        ).expected_remaining
        == 1
    )
    assert (
        RequestProgress(
            request_id="r", prompt_tokens=100, generated=40, max_tokens=50, predicted_remaining=900.0, remaining_at=40
        ).expected_remaining
        == 10
    )
