"""The simulator against hand-computed cases, and every policy through it."""

import random
from collections import Counter
from dataclasses import replace

import pytest

from llmesh.policies import POLICIES, QUEUE_POLICIES, make_policy, make_queue_policy
from llmesh.policies.banaserve import ModuleMigrationParams, RoleSwitchParams
from llmesh.policies.core import kv_blocks
from llmesh_sim.cluster import Migration, ModuleMigration, RoleSwitching, simulate, summarize
from llmesh_sim.engine import EngineProfile, Preemption, SimEngine, SimRequest

# 10 ms a step, 1 ms a prompt token, 2 ms a decoding request
PROFILE = EngineProfile(
    "hand",
    base_s=0.01,
    prefill_token_s=0.001,
    decode_seq_s=0.002,
    max_batched_tokens=1000,
    max_seqs=8,
    kv_blocks=100,
    block_size=16,
)


def test_one_engine_by_hand():
    """A: 100-token prompt at 0, 3 tokens out; B: 50 tokens at 0.05, 2 out.
    step 1 [0, 0.110]: A's prompt (0.01 + 0.100): A's first token at 0.110 (B arrived meanwhile);
    step 2 [0.110, 0.172]: B's prompt + A decodes (0.01 + 0.050 + 0.002): B's first, A's second;
    step 3 [0.172, 0.186]: both decode (0.01 + 0.004): both finish."""
    a, b = SimRequest("a", 0.0, 100, 3), SimRequest("b", 0.05, 50, 2)
    simulate([a, b], PROFILE, 1, make_policy("least_loaded"), make_queue_policy("fcfs"))
    assert a.ttft_s == pytest.approx(0.110) and b.ttft_s == pytest.approx(0.122)
    assert a.finished_at == pytest.approx(0.186) and b.finished_at == pytest.approx(0.186)
    assert a.tpot_s == pytest.approx(0.038) and b.tpot_s == pytest.approx(0.014)
    s = summarize([a, b], ttft_slo_s=0.115, tpot_slo_s=0.05)
    assert (s.completed, s.slo_attainment) == (2, 0.5)  # B's first token came 7 ms late


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    """1500 tokens with a 1000-token budget: 1000 in step 1 (1.01 s), 500 in step 2 (0.51 s)."""
    r = SimRequest("r", 0.0, 1500, 1)
    simulate([r], PROFILE, 1, make_policy("least_loaded"), make_queue_policy("fcfs"))
    assert r.ttft_s == pytest.approx(1.52) and r.finished_at == pytest.approx(1.52)


def test_a_full_engine_queues_at_the_router_and_the_queue_policy_orders():
    """One sequence at a time: B (arrived first) and C (priority -1) wait behind A; C goes first."""
    one = EngineProfile("one", base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.0, max_seqs=1)
    a, b, c = SimRequest("a", 0.0, 10, 1), SimRequest("b", 0.001, 10, 1), SimRequest("c", 0.002, 10, 1, priority=-1)
    simulate([a, b, c], one, 1, make_policy("least_loaded"), make_queue_policy("priority"))
    assert a.first_token_at == pytest.approx(0.02)
    assert c.first_token_at == pytest.approx(0.04) and b.first_token_at == pytest.approx(0.06)


def test_round_robin_alternates_and_least_loaded_fills_the_idle_engine():
    def reqs():
        return [SimRequest("long", 0.0, 10, 500)] + [SimRequest(f"r{i}", 0.1 + i * 0.5, 10, 2) for i in range(4)]

    rr = simulate(reqs(), PROFILE, 2, make_policy("round_robin"), make_queue_policy("fcfs"))
    assert [r.worker_id for r in rr] == ["e000", "e001", "e000", "e001", "e000"]
    ll = simulate(reqs(), PROFILE, 2, make_policy("least_loaded"), make_queue_policy("fcfs"))
    other = {"e000": "e001", "e001": "e000"}[ll[0].worker_id]
    assert [r.worker_id for r in ll][1:] == [other] * 4  # the short ones never share with the long one


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("queue_policy", sorted(QUEUE_POLICIES))
def test_every_policy_runs_a_short_trace_to_the_end(policy, queue_policy):
    rng = random.Random(1)
    reqs = [
        SimRequest(
            f"r{i}",
            i * 0.02,
            rng.randint(20, 400),
            rng.randint(2, 60),
            ttft_slo_s=2.0,
            predicted_tokens=rng.randint(2, 60),
        )
        for i in range(60)
    ]
    done = simulate(reqs, PROFILE, 3, make_policy(policy), make_queue_policy(queue_policy))
    s = summarize(done, ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert s.completed + s.refused == 60
    assert all(r.generated == r.output_tokens for r in done if not r.refused)


def test_the_command_runs_a_trace_slice_and_writes_its_table(tmp_path):
    from llmesh_sim.__main__ import main

    assert (
        main(
            [
                "--profile",
                "sim/profiles/cpu-tiny.json",
                "--trace",
                "azure-conv",
                "--requests",
                "40",
                "--rates",
                "1",
                "2",
                "--policies",
                "least_loaded",
                "llumnix",
                "--queue-policies",
                "fcfs",
                "edf",
                "--input-scale",
                "0.5",
                "--output-scale",
                "0.25",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    import json

    points = json.loads((tmp_path / "sim.json").read_text())["points"]
    assert len(points) == 2 * 2 * 2 and all(p["requests"] == 40 for p in points)
    table = (tmp_path / "sim.md").read_text()
    assert "| llumnix | edf | oracle | 2 |" in table and "| llumnix | edf | oracle |" in table.split("Highest")[1]


def test_the_calibration_fit_recovers_a_known_profile():
    from llmesh.wire.config import WorkerSettings
    from llmesh_sim.calibrate import fit

    true = EngineProfile(
        "t", base_s=0.004, prefill_token_s=0.0006, decode_seq_s=0.0008, context_token_s=4e-7, prefill_attention_s=3e-8
    )
    prefills = [(n, true.prefill_s(n)) for n in (64, 512, 1024, 1536)]
    decodes = [(b, c, true.step_s(0, b, c)) for b, c in ((1, 100), (4, 2000), (16, 1600), (16, 9000))]
    profile, report = fit("t", prefills, decodes, 4096, WorkerSettings(), "synthetic")
    assert profile.base_s == pytest.approx(0.004) and profile.prefill_token_s == pytest.approx(0.0006)
    assert profile.decode_seq_s == pytest.approx(0.0008) and profile.context_token_s == pytest.approx(4e-7)
    assert profile.prefill_attention_s == pytest.approx(3e-8)
    assert all(abs(f - m) < 1e-9 for _, m, f in report)


def test_prefill_and_decode_pools_by_hand():
    """A: 100-token prompt, 3 tokens out, on 1 prefill + 1 decode engine, KV transfer 0.1 ms a token.
    Prefill [0, 0.110]: first token; KV at the decode engine at 0.120; two decode steps of 12 ms
    (0.132, 0.144). B, 1 token out, ends on the prefill engine."""
    profile = EngineProfile(
        "pd",
        base_s=0.01,
        prefill_token_s=0.001,
        decode_seq_s=0.002,
        max_batched_tokens=1000,
        max_seqs=8,
        kv_blocks=100,
        block_size=16,
        kv_transfer_token_s=0.0001,
    )
    a, b = SimRequest("a", 0.0, 100, 3), SimRequest("b", 0.5, 50, 1)
    simulate([a, b], profile, 1, make_policy("least_loaded"), make_queue_policy("edf"), prefill_instances=1)
    assert a.ttft_s == pytest.approx(0.110) and a.finished_at == pytest.approx(0.144)
    assert a.worker_id == "p000" and a.tpot_s == pytest.approx(0.017)
    assert b.finished_at == pytest.approx(0.5 + 0.06) and b.worker_id == "p000"


def test_after_its_first_token_a_request_is_not_refused_for_its_ttft_target():
    """EDF drops hopeless requests; one whose first token is out (waiting for decode) is not one."""
    profile = EngineProfile("pd", base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002, max_seqs=1)
    reqs = [SimRequest(f"r{i}", 0.0, 100, 20, ttft_slo_s=0.5) for i in range(4)]
    simulate(reqs, profile, 1, make_policy("least_loaded"), make_queue_policy("edf"), prefill_instances=1)
    assert all(r.finished_at is not None for r in reqs if r.first_token_at is not None)


@pytest.mark.parametrize("margin, site", [(None, "p000"), (0.25, "e000")])
def test_conditional_disaggregation_sends_a_prompt_past_a_long_prefill_queue(margin, site):
    """The prefill engine holds a 1500-token prompt (1.5 s); a 100-token one arriving next would
    wait behind it, while the idle decode engine computes it in 0.1 s: it goes there (as the
    router decides, llmesh.policies.disagg), unless conditional disaggregation is off."""
    long, short = SimRequest("long", 0.0, 1500, 2), SimRequest("short", 0.01, 100, 2)
    simulate(
        [long, short],
        PROFILE,
        1,
        make_policy("least_loaded"),
        make_queue_policy("fcfs"),
        prefill_instances=1,
        local_prefill_margin_s=margin,
    )
    assert long.worker_id == "p000" and short.worker_id == site
    assert short.finished_at is not None


def test_fidelity_replays_a_measured_point(tmp_path, capsys):
    import json

    from llmesh_sim.fidelity import main

    requests = {
        "start_s": [0.0, 0.5, 1.0],
        "prompt_tokens": [100, 200, 50],
        "output_tokens": [3, 3, 3],
        "ttft_ms": [110.0, 215.0, 60.0],
        "tpot_ms": [12.0, 12.0, 12.0],
    }
    points = [{"deployment": d, "workload": "trace", "rate": 1, "requests": requests} for d in ("mesh", "vllm")]
    (tmp_path / "results.json").write_text(json.dumps({"points": points}))
    (tmp_path / "p.json").write_text(
        json.dumps({"name": "hand", "base_s": 0.01, "prefill_token_s": 0.001, "decode_seq_s": 0.002})
    )
    assert main(["--results", str(tmp_path / "results.json"), "--profile", str(tmp_path / "p.json")]) == 0
    rows = [
        line.split(" | ")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| mesh") or line.startswith("| vllm")
    ]
    # alone on an idle engine each prompt takes 10 ms + 1 ms a token: P50 110 ms measured and simulated
    assert [(r[0], r[4], r[5]) for r in rows] == [("| mesh", "110", "110"), ("| vllm", "110", "110")]
    beside = ["--beside-prefill", str(tmp_path / "p.json"), "--beside-decode", str(tmp_path / "p.json")]
    assert main(["--results", str(tmp_path / "results.json"), "--profile", str(tmp_path / "p.json"), *beside]) == 0
    assert "| mesh | trace | 1 | 3 | 110 | 110 |" in capsys.readouterr().out  # the same profiles: the same times
    # the mesh's lone probes: 8 tokens in 30 ms where the profile gives 18 (12 ms of path), 208 tokens in 238
    # where it gives 218 (20): 12 ms + 0.04 ms a token; the replay's median prompt, 100 tokens, gets 15.68 ms
    probes = [
        {"deployment": "mesh", "prompt_tokens": 8, "ttft_ms": [29.0, 30.0, 31.0], "workload": "trace"},
        {"deployment": "mesh", "prompt_tokens": 208, "ttft_ms": [238.0], "workload": "trace"},
    ]
    (tmp_path / "results.json").write_text(json.dumps({"points": points, "path_probes": probes}))
    assert main(["--results", str(tmp_path / "results.json"), "--profile", str(tmp_path / "p.json"), "--path"]) == 0
    out = capsys.readouterr().out
    assert "mesh's request path: 12.0 ms at 8 tokens, 20.0 ms at 208 tokens" in out
    assert "| mesh | trace | 1 | 3 | 110 | 126 |" in out  # 110 + 15.68
    assert "| vllm | trace | 1 | 3 | 110 | 110 |" in out  # no probes: no path


@pytest.mark.parametrize(
    "mode, b_ttft",
    [
        ("none", 0.010 + 0.2),  # B computes its whole 200-token prompt
        ("local", 0.010 + 0.1),  # on A's engine, its first 100 tokens are in vLLM's cache: free
        ("global", 0.010 + 0.1 + 100 * 0.0002),  # from the global store, 0.2 ms a token to load
    ],
)
def test_prefix_reuse_by_hand(mode, b_ttft):
    """A (100 tokens, block ids [1]) then B (200 tokens, [1, 2]), 100-token blocks, one engine."""
    profile = EngineProfile("p", base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.0, kv_transfer_token_s=0.0002)
    a = SimRequest("a", 0.0, 100, 1, prefix_hashes=(1,))
    b = SimRequest("b", 1.0, 200, 1, prefix_hashes=(1, 2))
    simulate(
        [a, b],
        profile,
        1,
        make_policy("least_loaded"),
        make_queue_policy("fcfs"),
        prefix_cache=mode,
        prefix_block_tokens=100,
    )
    assert b.ttft_s == pytest.approx(b_ttft) and b.cached_tokens == (0 if mode == "none" else 100)


def test_the_global_store_serves_every_engine_and_a_local_cache_only_its_own():
    """Round-robin puts A on e000 and B on e001: only the global store lets B reuse A's prefix."""
    profile = EngineProfile("p", base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.0)
    for mode, cached in (("local", 0), ("global", 100)):
        a, b = SimRequest("a", 0.0, 100, 1, prefix_hashes=(1,)), SimRequest("b", 1.0, 200, 1, prefix_hashes=(1, 2))
        simulate(
            [a, b],
            profile,
            2,
            make_policy("round_robin"),
            make_queue_policy("fcfs"),
            prefix_cache=mode,
            prefix_block_tokens=100,
        )
        assert (a.worker_id, b.worker_id, b.cached_tokens) == ("e000", "e001", cached)


def test_cache_aware_routing_follows_the_prefix_it_sent():
    profile = EngineProfile("p", base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.0)
    reqs = [SimRequest(f"r{i}", i * 1.0, 200, 1, prefix_hashes=(7, 100 + i)) for i in range(4)]
    simulate(
        reqs,
        profile,
        3,
        make_policy("cache_aware", {"cache_threshold": 0.4}),
        make_queue_policy("fcfs"),
        prefix_cache="local",
        prefix_block_tokens=100,
    )
    assert len({r.worker_id for r in reqs}) == 1 and [r.cached_tokens for r in reqs] == [0, 100, 100, 100]


def test_a_request_held_back_past_the_queue_limit_is_refused():
    """Ascendra holds back a request no instance can serve in time; without a dropping queue policy
    it is refused when its wait reaches max_wait_s, as the router refuses it."""
    one = EngineProfile("one", base_s=0.01, prefill_token_s=0.001, decode_seq_s=0.0, max_seqs=8)
    long, late = SimRequest("long", 0.0, 1000, 1), SimRequest("late", 0.001, 100, 1, ttft_slo_s=0.5)
    simulate([long, late], one, 1, make_policy("ascendra"), make_queue_policy("fcfs"), max_wait_s=2.0)
    assert long.finished_at is not None and late.refused and late.first_token_at is None


@pytest.mark.parametrize("trace, has_blocks", [("sharegpt", False), ("mooncake-conv", True), ("azure-code", False)])
def test_each_trace_reads_into_requests(trace, has_blocks):
    from llmesh_sim.__main__ import TRACES, read_trace, workload

    if not TRACES[trace].exists():
        pytest.skip(f"{TRACES[trace]} is not beside this checkout")
    rows = read_trace(trace)
    arrivals = [t for t, *_ in rows[:200]]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    reqs = workload(
        rows, 50, rate=5.0, input_scale=1.0, output_scale=1.0, max_tokens=4096, ttft_slo_s=1.0, tpot_slo_s=0.1
    )
    assert len(reqs) == 50 and all(
        1 <= r.output_tokens <= 1024 and r.prompt_tokens + r.output_tokens <= 4096 for r in reqs
    )
    assert reqs[-1].arrival == pytest.approx(49 / 5.0)  # gaps rescaled to the rate
    assert any(r.prefix_hashes for r in reqs) is has_blocks
    assert all(len(r.prefix_hashes) <= -(-r.prompt_tokens // 512) for r in reqs)  # block ids of the prompt kept


def test_a_static_partition_sends_each_model_only_to_its_own_engines():
    """Two models on three engines in turn (e000, e002: a; e001: b): each request runs on an engine of its
    model, and a model no engine serves waits out the router's queue and is refused."""
    requests = [
        SimRequest(f"r{i}", arrival=i * 0.01, prompt_tokens=64, output_tokens=8, model=model)
        for i, model in enumerate(["a", "b", "a", "b", "a", "c"] * 4)
    ]
    done = simulate(
        requests, PROFILE, 3, make_policy("least_loaded"), make_queue_policy("fcfs"), models=("a", "b"), max_wait_s=1.0
    )
    served = {(r.model, r.worker_id) for r in done if not r.refused}
    assert served == {("a", "e000"), ("a", "e002"), ("b", "e001")}
    assert all(r.finished_at is not None for r in done if r.model != "c")
    assert all(r.refused for r in done if r.model == "c")


def _run_alone(engine: SimEngine, requests: list[SimRequest]) -> dict:
    """Every request given to `engine` at 0, stepped to the end; what each step computed and held."""
    engine.waiting.extend(requests)
    now, prefill_tokens, swapped_out, recomputed_outputs = 0.0, 0, 0, 0
    preemptions = {r.request_id: 0 for r in requests}
    while True:
        cpu_before = engine.cpu_blocks_used
        end = engine.start_step(now)
        if end is None:
            break
        swapped_out += max(engine.cpu_blocks_used - cpu_before, 0)
        for r in requests:
            if r.preemptions > preemptions[r.request_id]:
                preemptions[r.request_id] = r.preemptions
                recomputed_outputs += r.recomputing if r.swaps < r.preemptions else 0
        limit = engine.profile.kv_blocks
        assert sum(kv_blocks(r.prompt_tokens + r.generated + r.decoding, 16) for r in engine.running) <= limit
        prefill_tokens += sum(chunk for _, chunk in engine._plan)
        engine.finish_step(end)
        now = end
    return {"end": now, "prefill_tokens": prefill_tokens, "swapped_out": swapped_out, "recomputed": recomputed_outputs}


def _pressed(**preemption) -> tuple[SimEngine, SimRequest, SimRequest]:
    """Two requests whose outputs outgrow a 4-block (64-token) KV space together: 20 + 30 tokens each."""
    engine = SimEngine("e", replace(PROFILE, kv_blocks=4), preemption=Preemption(**preemption))
    return engine, SimRequest("a", 0.0, 20, 30), SimRequest("b", 0.0, 20, 30)


def test_preemption_by_recompute_keeps_kv_within_its_blocks_and_computes_the_victims_tokens_again():
    """vLLM's: the request admitted last leaves the batch once both cross into their third block, its
    prompt and output so far computed again when it resumes; both finish their 30 tokens."""
    engine, a, b = _pressed(mode="recompute")
    run = _run_alone(engine, [a, b])
    assert (a.preemptions, b.preemptions, b.swaps) == (0, 1, 0)
    assert a.generated == b.generated == 30 and a.finished_at < b.finished_at
    assert run["prefill_tokens"] == 20 + 20 + 20 + run["recomputed"] and run["recomputed"] > 0


def test_preemption_by_swap_copies_the_victims_blocks_out_and_back_at_their_copy_time():
    engine, a, b = _pressed(mode="swap", cpu_blocks=8, swap_block_s=0.5)
    run = _run_alone(engine, [a, b])
    assert (b.preemptions, b.swaps) == (1, 1) and engine.cpu_blocks_used == 0
    assert run["prefill_tokens"] == 40 and run["swapped_out"] == 2  # b held 32 tokens: 2 blocks
    free_engine, *free = _pressed(mode="swap", cpu_blocks=8, swap_block_s=1e-12)
    assert run["end"] - _run_alone(free_engine, free)["end"] == pytest.approx(2 * 2 * 0.5)  # out, then back in


def test_a_swap_the_cpu_space_cannot_hold_recomputes_instead():
    engine, a, b = _pressed(mode="swap", cpu_blocks=1, swap_block_s=0.5)
    _run_alone(engine, [a, b])
    assert (b.preemptions, b.swaps) == (1, 0) and b.generated == 30


@pytest.mark.parametrize(("swap_block_s", "swaps"), [(1e-6, 1), (1.0, 0)])
def test_auto_preemption_swaps_only_when_the_copies_cost_less_than_computing_again(swap_block_s, swaps):
    """AdaptiveLLM's choice at preemption time: 2 blocks out and back against ~32 tokens at 1 ms each."""
    engine, a, b = _pressed(mode="auto", cpu_blocks=8, swap_block_s=swap_block_s)
    _run_alone(engine, [a, b])
    assert (b.preemptions, b.swaps) == (1, swaps)


def test_the_fairness_victim_is_the_lowest_time_in_the_system_over_predicted_length():
    """AdaptiveLLM's victim: `a`, admitted first but predicted ten times longer, goes instead of the last admitted."""
    engine, a, b = _pressed(mode="recompute", victim="fairness")
    a.predicted_tokens, b.predicted_tokens = 300.0, 30.0
    _run_alone(engine, [a, b])
    assert (a.preemptions, b.preemptions) == (1, 0) and a.generated == b.generated == 30


def test_under_preemption_a_request_larger_than_the_kv_space_is_refused_not_left_waiting():
    engine, a, _ = _pressed(mode="recompute")
    huge = SimRequest("huge", 0.0, 100, 1)
    _run_alone(engine, [huge, a])
    assert huge.refused and huge.first_token_at is None and a.generated == 30


def test_the_adaptive_experiment_runs_every_system_under_pressure_and_writes_its_table(tmp_path):
    from llmesh_sim.__main__ import TRACES
    from llmesh_sim.adaptive import main

    if not TRACES["sharegpt"].exists():
        pytest.skip(f"{TRACES['sharegpt']} is not beside this checkout")
    out = tmp_path / "adaptive.md"
    assert main(["--requests", "60", "--offline", "--predictions", "none", "oracle", "--out", str(out)]) == 0
    rows = {
        tuple(cells[:2]): cells
        for line in out.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| system")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {
        ("recompute", "-"),
        ("swap", "-"),
        ("adaptive", "none"),
        ("adaptive", "oracle"),
        ("cost-only", "-"),
    }
    assert rows["recompute", "-"][3] == "1.00x" and int(rows["recompute", "-"][7]) > 0  # KV pressure preempts
    assert int(rows["swap", "-"][8]) > 0 and int(rows["recompute", "-"][8]) == 0  # swapped: only where allowed
    assert all(cells[-1] == "0" for cells in rows.values())  # nothing refused: every request fits the KV


def _skewed(downtime_s: float, copy_block_s: float = 0.0) -> tuple[SimRequest, SimRequest, SimRequest]:
    """Round robin leaves two long requests on e000 (10 blocks of KV, both growing) and a short one on e001,
    which then empties: placement's pairing moves the long request with the fewer tokens (`b`) there."""
    a, short, b = SimRequest("a", 0.0, 60, 200), SimRequest("short", 0.001, 10, 2), SimRequest("b", 0.002, 60, 200)
    migration = Migration(
        interval_s=0.5, source_below=3, destination_above=5, copy_block_s=copy_block_s, downtime_s=downtime_s
    )
    profile = replace(PROFILE, kv_blocks=10)
    simulate([a, short, b], profile, 2, make_policy("round_robin"), make_queue_policy("fcfs"), migration=migration)
    return a, short, b


def test_live_migration_moves_the_cheapest_request_off_the_least_free_engine_and_pauses_it_for_the_downtime():
    a, short, b = _skewed(downtime_s=0.0)
    assert (a.migrations, short.migrations, b.migrations) == (0, 0, 1)
    assert b.worker_id == "e001" and a.worker_id == "e000" and b.generated == a.generated == 200
    _, _, paused = _skewed(downtime_s=1.0)
    assert paused.finished_at - b.finished_at == pytest.approx(1.0)  # it decodes alone there either way


def test_a_request_that_finishes_while_its_kv_is_copied_stays_where_it_ran():
    a, _, b = _skewed(downtime_s=0.0, copy_block_s=100.0)
    assert a.migrations == b.migrations == 0 and b.worker_id == "e000" and b.generated == 200


def test_the_llumnix_experiment_runs_each_system_and_only_llumnixs_migrate(tmp_path):
    from llmesh_sim.llumnix import main

    out = tmp_path / "llumnix.md"
    argv = ["--requests", "300", "--lengths", "long-tail", "--instances", "2", "--kv-blocks", "40", "--rates", "8"]
    assert main([*argv, "--out", str(out)]) == 0
    rows = {
        cells[0]: cells
        for line in out.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| system")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert set(rows) == {"round-robin", "INFaaS++", "Llumnix dispatch", "Llumnix", "Llumnix, head-of-line dispatch"}
    assert rows["INFaaS++"][3] == "1.00x" and rows["round-robin"][7] == "1.00x"
    assert all(int(cells[8]) > 0 for cells in rows.values())  # KV short enough to preempt everywhere
    migrating = {"Llumnix", "Llumnix, head-of-line dispatch"}
    assert all(int(rows[s][9]) > 0 for s in migrating) and all(int(rows[s][9]) == 0 for s in rows.keys() - migrating)
    assert all(cells[10] == "0" for cells in rows.values())  # every request completed


@pytest.mark.parametrize("policy", ["llumnix", "least_loaded"])
def test_with_the_routers_views_a_burst_between_heartbeats_spreads_over_the_engines(policy):
    """A long request on each engine, in both their heartbeats (at 0.5 and 1 s); then eight requests at
    once, before either's next: the router's own account of what it sent since (`assigned`, and its
    prompts' blocks) spreads them, four an engine."""
    long = [SimRequest(f"long{i}", 0.001 * i, 50, 500) for i in range(2)]
    burst = [SimRequest(f"r{i}", 1.1 + 0.001 * i, 50, 20) for i in range(8)]
    simulate(long + burst, PROFILE, 2, make_policy(policy), make_queue_policy("fcfs"), heartbeat_views=True)
    assert {r.worker_id for r in long} == {"e000", "e001"}
    assert sorted(Counter(r.worker_id for r in burst).values()) == [4, 4]
    assert all(r.generated == r.output_tokens for r in long + burst)


def test_role_switching_moves_decode_engines_to_a_prefill_pool_that_falls_behind():
    """One prefill and three decode engines; 800-token prompts every 0.1 s take 0.81 s each on a prefill
    engine, so its queue grows while the decode engines idle: placement's BanaServe switching (the production
    `pick_role_switch`) gives it decode engines, every request still completes, and prompts wait less."""
    reqs = [SimRequest(f"r{i}", 0.1 * i, 800, 5) for i in range(60)]
    switching = RoleSwitching(0.5, RoleSwitchParams(hold_s=0.5, cooldown_s=1.0))
    fixed, switched = ([replace(r) for r in reqs] for _ in range(2))
    args = (PROFILE, 3, make_policy("least_loaded"), make_queue_policy("fcfs"))
    simulate(fixed, *args, prefill_instances=1, max_wait_s=float("inf"))
    simulate(switched, *args, prefill_instances=1, max_wait_s=float("inf"), role_switching=switching)
    assert all(r.generated == r.output_tokens and r.finished_at is not None for r in fixed + switched)
    assert {r.worker_id for r in fixed} == {"p000"}  # where each prompt was computed
    assert {r.worker_id for r in switched} > {"p000"}  # ... and switched decode engines' too
    assert summarize(switched, 1, 1).ttft_p99_s < summarize(fixed, 1, 1).ttft_p99_s / 2


def test_module_migration_switches_a_prefill_engine_and_moves_kv_to_it():
    """Two prefill and two decode engines of 60 KV blocks; long streams (160 prompt tokens, 200 out: up to 23
    blocks) fill the decode engines while the prefill engines idle between prompts: Algorithm 4-1 (the production
    `plan_module_migrations`) switches a prefill engine to decode and moves KV onto it; every request completes,
    the last 1 s sooner than on the static split."""
    profile = replace(PROFILE, kv_blocks=60, max_seqs=4)
    reqs = [SimRequest(f"r{i}", 0.25 * i, 160, 200) for i in range(12)]
    static, migrated = ([replace(r) for r in reqs] for _ in range(2))
    modules = ModuleMigration(0.5, ModuleMigrationParams(min_ratio=0.1, block_s=0.001))
    args = (profile, 2, make_policy("least_loaded"), make_queue_policy("fcfs"))
    simulate(static, *args, prefill_instances=2, max_wait_s=float("inf"))
    simulate(migrated, *args, prefill_instances=2, max_wait_s=float("inf"), module_migration=modules)
    assert all(r.generated == r.output_tokens and r.finished_at is not None for r in static + migrated)
    assert modules.switched == [(1.0, "p000", "decode")]
    assert ("r3", "e000", "p000") == modules.moved[0][1:] and len(modules.moved) > 1
    assert sum(r.migrations for r in migrated) == len(modules.moved)
    assert max(r.finished_at for r in migrated) < max(r.finished_at for r in static) - 1


def test_prefill_first_engines_stall_their_streams_for_every_prompt():
    """vLLM V0's scheduler. A: 100-token prompt at 0, 4 out; B: 50 tokens at 0.115, 2 out. Both ways:
    [0, 0.110] A's prompt, [0.110, 0.122] A decodes. Chunked prefill: [0.122, 0.184] B's prompt with A's
    third token, [0.184, 0.198] both decode, both done. Prefill first: [0.122, 0.182] B's prompt alone,
    [0.182, 0.196] both decode (B done), [0.196, 0.208] A's last token."""
    finished = {}
    for prefill_first in (False, True):
        a, b = SimRequest("a", 0.0, 100, 4), SimRequest("b", 0.115, 50, 2)
        profile = replace(PROFILE, prefill_first=prefill_first)
        simulate([a, b], profile, 1, make_policy("least_loaded"), make_queue_policy("fcfs"))
        finished[prefill_first] = (a.finished_at, b.finished_at)
    assert finished[False] == pytest.approx((0.198, 0.198))
    assert finished[True] == pytest.approx((0.208, 0.196))


def test_the_banaserve_experiment_runs_each_system(tmp_path):
    from llmesh_sim.banaserve import main

    out = tmp_path / "banaserve.md"
    assert main(["--requests", "200", "--rates", "30", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 30 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["vLLM", "vLLM V0", "DistServe", "BanaServe", "BanaServe 4-1"]
    assert all(r.rstrip(" |").endswith("| 0") for r in rows)  # every request completed


def test_the_gaps_between_tokens_count_the_steps_that_stall_a_stream():
    """The prefill-first case above: A's tokens at 0.110, 0.122, 0.196 and 0.208 (B's prompt step held the
    third back); its longest gap is 74 ms, and with a 50 ms target one gap of three missed it."""
    a, b = SimRequest("a", 0.0, 100, 4, tpot_slo_s=0.05), SimRequest("b", 0.115, 50, 2)
    simulate([a, b], replace(PROFILE, prefill_first=True), 1, make_policy("least_loaded"), make_queue_policy("fcfs"))
    assert a.tbt_max_s == pytest.approx(0.074) and a.tbt_misses == 1
    assert b.tbt_max_s == pytest.approx(0.014) and b.tbt_misses == 0  # B has no target


def test_the_ascendra_experiment_runs_each_system(tmp_path):
    from llmesh_sim.ascendra import main

    out = tmp_path / "ascendra.md"
    assert main(["--requests", "150", "--rates", "4", "--out", str(out)]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()]
    rows = [r for r in rows if r[0] == "4"]
    assert [r[1] for r in rows] == ["vLLM", "Sarathi", "Sarathi, EDF admission", "Ascendra dispatch", "Ascendra"]
    refused = {r[1]: int(r[-1]) for r in rows}
    assert refused["vLLM"] == refused["Sarathi"] == 0 and refused["Ascendra"] > 0  # overload: only EDF refuses


def test_the_first_token_path_delays_what_the_client_sees_not_the_engine():
    """test_one_engine_by_hand with 5 ms from each step to the client: every time the client sees moves by
    5 ms, the steps do not, so TPOT is unchanged."""
    a, b = SimRequest("a", 0.0, 100, 3), SimRequest("b", 0.05, 50, 2)
    profile = replace(PROFILE, first_token_s=0.005)
    simulate([a, b], profile, 1, make_policy("least_loaded"), make_queue_policy("fcfs"))
    assert a.ttft_s == pytest.approx(0.115) and b.ttft_s == pytest.approx(0.127)
    assert a.finished_at == pytest.approx(0.191) and a.tpot_s == pytest.approx(0.038)


def test_engines_sharing_a_host_step_slower_while_another_is_mid_step():
    """Two engines, round-robin: A (100 tokens) alone on e000 takes its lone 0.110 s; B (50 tokens) arrives
    at 0.05 on e001 while e000 is mid-step, so its prompt step takes the shared profile's times (twice)."""
    shared = replace(PROFILE, base_s=0.02, prefill_token_s=0.002, decode_seq_s=0.004)
    a, b = SimRequest("a", 0.0, 100, 1), SimRequest("b", 0.05, 50, 1)
    policy, fcfs = make_policy("round_robin"), make_queue_policy("fcfs")
    simulate([a, b], PROFILE, 2, policy, fcfs, shared_profiles={"prefill": shared, "decode": shared})
    assert a.ttft_s == pytest.approx(0.110) and b.ttft_s == pytest.approx(0.120)


def test_a_step_takes_the_times_measured_beside_what_the_other_engine_runs():
    """A (100 tokens, 3 out) on e000: its prompt alone until 0.110, then decode steps of 12 ms. B (50 tokens)
    arrives at 0.115 on e001, while A decodes: its prompt takes the beside-decode times (1.5 ms a token: 85 ms).
    A's next decode step starts at 0.122 beside B's prompt: the beside-prefill times (24 ms), so A ends at 0.146."""
    beside = {
        "prefill": replace(PROFILE, base_s=0.02, prefill_token_s=0.002, decode_seq_s=0.004),
        "decode": replace(PROFILE, prefill_token_s=0.0015),
    }
    a, b = SimRequest("a", 0.0, 100, 3), SimRequest("b", 0.115, 50, 1)
    simulate([a, b], PROFILE, 2, make_policy("round_robin"), make_queue_policy("fcfs"), shared_profiles=beside)
    assert b.ttft_s == pytest.approx(0.085) and a.finished_at == pytest.approx(0.146)
