"""Several models per GPU in the simulator: Prism against static partitioning (llmesh_sim.prism)."""

import random

import pytest

from llmesh.policies.prism import Device, ModelDemand, place_models
from llmesh_sim.engine import EngineProfile, SimRequest
from llmesh_sim.prism import Memory, MultiModelCluster, Run, Settings, held, highest_load, main

PROFILE = EngineProfile("t", base_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3, block_size=16)
BLOCK = 1000  # bytes of a KV block, in these tests
WEIGHTS = 300 * BLOCK


def memory(kv_blocks_with_one_model: int) -> Memory:
    return Memory(WEIGHTS + kv_blocks_with_one_model * BLOCK, WEIGHTS, BLOCK)


def req(i, model, at, prompt=100, output=5, slo=1.0):
    return SimRequest(f"r{i}", at, prompt, output, ttft_slo_s=slo, tpot_slo_s=1.0, model=model)


def cluster(system, rates, devices=1, kv_blocks=200, **settings):
    s = Settings(**{"ttft_slo_s": 1.0, "activation_s": 0.7, "idle_after_s": 10.0, **settings})
    return MultiModelCluster(PROFILE, memory(kv_blocks), devices, system == "prism", rates, s)


def resident(c):
    return {d.device_id: sorted(d.instances) for d in c.devices}


def test_a_model_resident_nowhere_is_activated_by_its_request_which_waits_the_activation_time():
    # one device, room for one model's weights: a is placed, b is not
    c = cluster("prism", {"a": 2.0, "b": 1.0})
    assert resident(c) == {"gpu0": ["a"]}
    a, b = req(0, "a", 0.0), req(1, "b", 20.0)
    c.run([a, b])
    assert a.ttft_s == pytest.approx(PROFILE.prefill_s(100))  # resident: served at once
    # a, idle 20 s > 10 s, makes room; b waits its 0.7 s of activation, then its prompt
    assert b.first_token_at == pytest.approx(20.0 + 0.7 + PROFILE.prefill_s(100))
    assert (c.activations, c.evictions) == (1, 1) and resident(c) == {"gpu0": ["b"]}


def test_a_busy_model_is_not_evicted_the_new_one_waits_until_it_is_idle_long_enough():
    c = cluster("prism", {"a": 2.0, "b": 1.0})
    a, b = req(0, "a", 0.0), req(1, "b", 3.0)
    c.run([a, b])
    # a went idle at its end (~0.05 s): it may go 10 s later, at the first tick past that
    assert a.finished_at + 10.0 <= b.first_token_at - 0.7 <= a.finished_at + 10.0 + c.s.tick_s
    assert b.finished_at is not None and not b.refused


def test_eviction_frees_memory_for_the_kv_of_a_queued_request():
    # two models fit with 100 blocks of KV between them; a 1600-token prompt needs 101
    c = cluster("prism", {"a": 2.0, "b": 1.0}, kv_blocks=400)
    assert resident(c) == {"gpu0": ["a", "b"]} and c.devices[0].kv_total_blocks() == 100
    long = req(0, "a", 15.0, prompt=1600)  # b idle since the start: past the threshold
    c.run([long])
    assert c.evictions == 1 and resident(c) == {"gpu0": ["a"]} and c.devices[0].kv_total_blocks() == 400
    assert long.first_token_at == pytest.approx(15.0 + c.s.tick_s, abs=c.s.tick_s)
    # static partitioning gives a half of the 100 blocks: that prompt is never admitted, and is refused
    s = cluster("static", {"a": 2.0, "b": 1.0}, kv_blocks=400)
    long = req(0, "a", 15.0, prompt=1600)
    s.run([long])
    assert long.refused and long.first_token_at is None and resident(s) == {"gpu0": ["a", "b"]}


def test_a_device_time_slices_its_models_one_step_at_a_time():
    c = cluster("prism", {"a": 1.0, "b": 1.0}, kv_blocks=400)
    a, b = req(0, "a", 0.0, prompt=1000, output=1), req(1, "b", 0.0, prompt=1000, output=1)
    c.run([a, b])
    first, second = sorted([a.first_token_at, b.first_token_at])
    assert first == pytest.approx(PROFILE.prefill_s(1000))
    assert second == pytest.approx(2 * PROFILE.prefill_s(1000))  # after the other's step, not beside it


@pytest.mark.parametrize("tight_slo, tight_first", [(2.0, True), (1.0, False)])
def test_the_shared_queue_goes_in_deadline_order_and_a_late_request_goes_last_not_out(tight_slo, tight_first):
    c = cluster("prism", {"a": 1.0})
    big = req(0, "a", 0.0, prompt=3000, output=50)  # 188 of the 200 blocks until ~0.85 s
    loose, tight = req(1, "a", 0.01, prompt=2000, slo=10.0), req(2, "a", 0.02, prompt=2000, slo=tight_slo)
    c.run([big, loose, tight])
    # room for one of the two at ~0.85 s: the later, tighter one, unless it cannot make its deadline
    # anyway (1.02 s, its prompt taking 0.21 s): then Moore-Hodgson puts it last in the round
    assert big.finished_at < min(tight.first_token_at, loose.first_token_at)
    assert (tight.first_token_at < loose.first_token_at) == tight_first
    assert all(r.finished_at is not None for r in (big, loose, tight))


def rates_then_traffic(system):
    """Initial rates put x and z together on gpu0; the traffic then makes them both busy."""
    c = cluster(system, {"x": 1.0, "y": 1.0, "z": 1.0}, devices=2, kv_blocks=2000, placement_interval_s=5.0)
    assert resident(c) == {"gpu0": ["x", "z"], "gpu1": ["y"]}  # Algorithm 1: x, then y on the other, z where lower
    traffic = [req(i, m, i * 0.1) for i, m in enumerate(["x", "z"] * 25)] + [req(99, "z", 7.0)]
    c.run(traffic)
    return c, traffic


def test_placement_is_algorithm_1_and_reruns_on_measured_rates():
    c, traffic = rates_then_traffic("prism")
    measured = [ModelDemand(m, r, 1.0, WEIGHTS) for m, r in (("x", 25 / 5), ("y", 0.0), ("z", 25 / 5))]
    devices = [Device(d, memory(2000).usable_bytes) for d in ("gpu0", "gpu1")]
    assert place_models(measured, devices)["z"] == ("gpu1",)  # what Algorithm 1 says of the measured rates
    assert c.moves == 1 and traffic[-1].worker_id == "gpu1/z"  # and where z's later request ran
    assert all(r.finished_at is not None for r in traffic)


def test_static_partitioning_never_moves_nor_evicts():
    c, traffic = rates_then_traffic("static")
    assert (c.moves, c.activations, c.evictions) == (0, 0, 0)
    assert {r.worker_id for r in traffic if r.model == "z"} == {"gpu0/z"}
    assert resident(c) == {"gpu0": ["x", "z"], "gpu1": ["y"]}


@pytest.mark.parametrize("system", ["prism", "static"])
def test_every_request_completes_or_is_refused_under_overload(system):
    rng = random.Random(1)
    models = [f"m{k}" for k in range(5)]
    rates = {m: 4.0 / (k + 1) for k, m in enumerate(models)}
    reqs, t = [], 0.0
    for i in range(600):
        t += rng.expovariate(20.0)
        model = rng.choices(models, weights=list(rates.values()))[0]
        reqs.append(req(i, model, t, prompt=rng.randint(50, 1500), output=rng.randint(1, 200), slo=0.5))
    c = cluster(system, rates, devices=2, kv_blocks=600, idle_after_s=1.0, placement_interval_s=5.0, max_wait_s=3.0)
    c.run(reqs)
    assert all((r.finished_at is not None) != r.refused for r in reqs)
    assert any(r.refused for r in reqs) and any(r.finished_at for r in reqs)  # overloaded, yet serving
    assert all(r.first_token_at is None or r.first_token_at >= r.arrival for r in reqs)


def test_the_search_finds_the_highest_load_that_holds_the_target():
    def run(rate):
        return Run(rate, 1.0 if rate <= 13.0 else 0.9, 0, 0, 0, 0)

    runs = highest_load(run, 0.99, start=4.0, precision=0.02)
    best = held(runs, 0.99)
    assert best is not None and 13.0 * 0.98 <= best.rate <= 13.0
    assert held(highest_load(lambda r: Run(r, 0.5, 0, 0, 0, 0), 0.99, start=4.0), 0.99) is None


def test_the_command_writes_its_table(tmp_path):
    out = tmp_path / "prism.md"
    argv = ["--models", "2", "--duration-s", "30", "--start-rate", "4", "--out", str(out)]
    assert main(argv) == 0
    table = out.read_text()
    assert "| 2 |" in table and "Prism / static" in table


def test_a_rate_that_fails_alone_does_not_end_the_search():
    """Past capacity above 6.2, and attainment dips at 4 alone (an unlucky burst there, as 8 models, seed 1,
    at 4 req/s): the search confirms each failure at the rate just above before taking it as past
    capacity, so the dip does not cap the answer."""

    def run(rate):
        return Run(rate, 0.98 if 3.9 <= rate <= 4.1 or rate > 6.2 else 1.0, 0, 0, 0, 0)

    runs = highest_load(run, 0.99, start=8.0, precision=0.02)
    assert any(3.9 <= r.rate <= 4.1 for r in runs)  # the dip was met
    best = held(runs, 0.99)
    assert best is not None and 6.2 * 0.96 <= best.rate <= 6.2, [(r.rate, r.attainment) for r in runs]
