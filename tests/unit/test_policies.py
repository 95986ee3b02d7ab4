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
