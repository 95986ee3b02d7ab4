"""The multi-model workload built from real services' traces (llmesh_sim.multimodel)."""

import random
from collections import Counter

import pytest

from llmesh_sim.multimodel import Burst, model_name, multimodel_workload


def poisson(rate: float, seconds: float, seed: int, prompt: int):
    rng, t, rows = random.Random(seed), 0.0, []
    while t < seconds:
        rows.append((t, prompt, 10, ()))
        t += rng.expovariate(rate)
    return rows


CONV, CODE = poisson(4.0, 3600, 1, prompt=1000), poisson(2.0, 3600, 2, prompt=2000)


def test_the_first_models_are_the_real_services_unchanged():
    arrivals = multimodel_workload([CONV, CODE], models=2, duration_s=600)
    for k, rows in enumerate((CONV, CODE)):
        got = [(a.at_s, a.prompt_tokens) for a in arrivals if a.model == model_name(k)]
        assert got == [(t, p) for t, p, _, _ in rows if t < 600]
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)


def test_further_models_follow_a_power_law_on_later_windows_of_the_services():
    arrivals = multimodel_workload([CONV, CODE], models=6, duration_s=600, popularity=1.0)
    counts = Counter(a.model for a in arrivals)
    for k in range(2, 6):
        source = counts[model_name(k % 2)]
        assert counts[model_name(k)] == pytest.approx(source * 2 / (k + 1), rel=0.2), (k, counts)
    # a later window: not the source's own arrivals thinned
    own = {a.at_s for a in arrivals if a.model == model_name(0)}
    assert not own & {a.at_s for a in arrivals if a.model == model_name(2)}
    assert {a.prompt_tokens for a in arrivals if a.model == model_name(3)} == {2000}  # code's lengths
    assert multimodel_workload([CONV, CODE], models=6, duration_s=600, seed=7) == multimodel_workload(
        [CONV, CODE], models=6, duration_s=600, seed=7
    )


def test_a_burst_raises_one_models_rate_and_its_trace_goes_on_after_it():
    burst = Burst(model_name(1), start_s=100, length_s=50, factor=4)
    arrivals = multimodel_workload([CONV, CODE], models=2, duration_s=600, bursts=[burst])
    code = [a.at_s for a in arrivals if a.model == model_name(1)]
    within = sum(100 <= t < 150 for t in code)
    assert within == pytest.approx(2.0 * 50 * 4, rel=0.25)  # 4x code's 2 req/s
    assert sum(450 <= t < 600 for t in code) == pytest.approx(2.0 * 150, rel=0.25)  # and on after it
    assert max(code) < 600
    plain = [a.at_s for a in arrivals if a.model == model_name(0)]
    assert plain == [t for t, *_ in CONV if t < 600]  # the other model untouched


def test_a_window_past_the_trace_wraps_around_and_bad_input_is_refused():
    short = poisson(1.0, 100, 3, prompt=50)
    arrivals = multimodel_workload([short], models=1, duration_s=350)
    assert len(arrivals) == pytest.approx(350, rel=0.25) and max(a.at_s for a in arrivals) < 350
    with pytest.raises(ValueError, match="overlap"):
        multimodel_workload([CONV], 1, 600, bursts=[Burst(model_name(0), 10, 50, 2), Burst(model_name(0), 40, 5, 2)])
    with pytest.raises(ValueError, match="trace"):
        multimodel_workload([CONV, []], 2, 600)
