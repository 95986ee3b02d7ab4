"""llmesh_sim.predictions: the three prediction modes and the held-out sampler (no model is loaded)."""

import json
import random

import pytest

from llmesh.wire.lengths import EDGES, NUM_BUCKETS
from llmesh_sim.engine import SimRequest
from llmesh_sim.predictions import DEFAULT_PROFILE, MODES, HeldOutPredictions, with_predictions

# buckets: [0,8) 0, [8,16) 1, [16,32) 2, [32,64) 3, ..., [1024,2048) 8, >=2048 9
ROWS = [
    [10, 11.0, 1, 0.5],
    [12, 30.0, 2, 0.4],
    [15, 9.5, 1, 0.6],  # bucket 1
    [40, 50.0, 3, 0.5],
    [60, 100.0, 4, 0.3],  # bucket 3
    [3000, 1500.0, 8, 0.4],  # bucket 9
]


def requests() -> list[SimRequest]:
    return [SimRequest(f"r{i}", float(i), 100, n) for i, n in enumerate([10, 40, 500, 3000, 1])]


def test_oracle_mode_predicts_the_true_length():
    reqs = with_predictions(requests(), "oracle", seed=0)
    assert [r.predicted_tokens for r in reqs] == [10.0, 40.0, 500.0, 3000.0, 1.0]


def test_none_mode_clears_the_prediction():
    reqs = requests()
    for r in reqs:
        r.predicted_tokens = 5.0
    assert all(r.predicted_tokens is None for r in with_predictions(reqs, "none", seed=0))


def test_real_mode_draws_from_the_held_out_rows_deterministically():
    heldout = HeldOutPredictions(ROWS)
    first = [r.predicted_tokens for r in with_predictions(requests(), "real", seed=3, heldout=heldout)]
    again = [r.predicted_tokens for r in with_predictions(requests(), "real", seed=3, heldout=heldout)]
    assert first == again
    assert first[0] in {11.0, 30.0, 9.5} and first[1] in {50.0, 100.0} and first[3] == 1500.0
    assert first[2] in {50.0, 100.0}  # 500 is bucket 6: none there, bucket 3 is the nearest (9 is farther)
    assert first[4] in {11.0, 30.0, 9.5}  # bucket 0: none there, bucket 1 is the nearest


def test_modes_refuse_what_they_cannot_do():
    assert MODES == ("oracle", "real", "none")
    with pytest.raises(ValueError, match="needs the held-out"):
        with_predictions(requests(), "real", seed=0)
    with pytest.raises(ValueError, match="unknown prediction mode"):
        with_predictions(requests(), "perfect", seed=0)


def test_predict_is_deterministic_for_a_seeded_rng_and_stays_in_the_bucket():
    heldout = HeldOutPredictions(ROWS)
    draws = [heldout.predict(12, random.Random(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    rng = random.Random(1)
    seen = {heldout.predict(12, rng) for _ in range(200)}
    assert seen == {11.0, 30.0, 9.5}  # every bucket-1 row, nothing else
    assert {heldout.predict(4000, rng) for _ in range(20)} == {1500.0}


def test_nearest_bucket_fallback_prefers_the_lower_of_two_as_near():
    heldout = HeldOutPredictions([[10, 11.0, 1, 0.5], [40, 50.0, 3, 0.5]])  # buckets 1 and 3
    assert heldout.source_bucket(20) == 1  # bucket 2: 1 and 3 are as near
    assert heldout.source_bucket(0) == 1 and heldout.source_bucket(100000) == 3
    assert heldout.bucket_of(EDGES[0] - 1) == 0 and heldout.bucket_of(EDGES[0]) == 1
    assert heldout.bucket_of(EDGES[-1]) == NUM_BUCKETS - 1
    with pytest.raises(ValueError):
        HeldOutPredictions([])


def test_the_committed_held_out_predictions_load():
    raw = json.loads(DEFAULT_PROFILE.read_text())
    assert DEFAULT_PROFILE.stat().st_size < 100_000
    assert raw["columns"] == ["actual_tokens", "expected_tokens", "bucket_index", "confidence"]
    assert raw["bucket_edges"] == list(EDGES)
    assert all(isinstance(x, (int, float)) for row in raw["rows"] for x in row)  # numbers only, no prompt text
    heldout = HeldOutPredictions.load()
    assert len(heldout.rows) == raw["scores"]["rows"] > 100
    assert all(0 <= row[2] < NUM_BUCKETS and 0 <= row[3] <= 1 for row in heldout.rows)
    assert heldout.predict(300, random.Random(0)) > 0
