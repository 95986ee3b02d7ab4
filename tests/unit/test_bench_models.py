"""bench/models.py's workload: three models from the two Azure services, the same share of arrivals each
time, lengths capped, in order."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # it imports bench/harness.py and serve.py, as a script run there does
spec = importlib.util.spec_from_file_location("bench_models", ROOT / "bench" / "models.py")
assert spec and spec.loader
models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models)


def test_the_workload_is_the_three_models_sampled_alike_each_time_and_capped():
    full = models.workload(60, 1.0, 512, 32, seed=0)
    assert {m for _, m, _, _ in full} == set(models.MODELS)
    assert [t for t, *_ in full] == sorted(t for t, *_ in full) and full[-1][0] < 60
    assert max(p for _, _, p, _ in full) <= 512 and max(o for *_, o in full) <= 32
    tenth = models.workload(60, 0.1, 512, 32, seed=0)
    assert tenth == models.workload(60, 0.1, 512, 32, seed=0) and set(tenth) <= set(full)
    assert 0.05 * len(full) < len(tenth) < 0.15 * len(full)


def test_a_scale_past_one_replays_a_longer_window_that_much_faster():
    once, twice = models.workload(60, 1.0, 512, 32, seed=0), models.workload(60, 2.0, 512, 32, seed=0)
    assert twice[-1][0] < 60 and 1.6 * len(once) < len(twice) < 2.4 * len(once)
