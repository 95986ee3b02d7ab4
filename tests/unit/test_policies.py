import random

import pytest

from llmesh.policies import WorkerSnapshot, least_loaded


def w(worker_id, running=0, queued=0, capacity=4, assigned=0):
    return WorkerSnapshot(worker_id, running, queued, capacity, assigned)


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
    picked = least_loaded(workers, random.Random(0))
    assert (picked.worker_id if picked else None) == expected


def test_ties_are_broken_by_the_seeded_rng_and_spread():
    workers = [w("a"), w("b"), w("c")]
    picks = [least_loaded(workers, random.Random(seed)).worker_id for seed in range(30)]
    assert picks == [least_loaded(workers, random.Random(seed)).worker_id for seed in range(30)]
    assert set(picks) == {"a", "b", "c"}
