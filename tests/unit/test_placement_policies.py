"""The placement service's pure decisions: which request moves, and the scaling band."""

import pytest

from llmesh.messages import RequestProgress, WorkerInfo
from llmesh.policies import RunningRequest, WorkerView
from llmesh.policies.llumnix import pick_migration, scaling_advice
from llmesh.views import worker_view


def req(rid, tokens, generated=1, priority=0, migrating=False):
    return RunningRequest(rid, tokens, generated, 64, None, priority, migrating)


def w(worker_id, requests=(), *, kv_total=100, role="decode", state="active"):
    return WorkerView(worker_id, role, "m", "f", capacity=8, running=len(requests), state=state,
                      kv_blocks_total=kv_total, block_size=16, requests=tuple(requests))


@pytest.mark.parametrize("requests, expected", [
    ([], None),
    ([req("a", 100), req("b", 20)], "b"),  # fewest tokens
    ([req("a", 10, generated=50), req("b", 40, generated=1)], "b"),  # prompt and output count alike
    ([req("a", 20, priority=-1), req("b", 900)], "b"),  # the urgent one stays, however small
    ([req("a", 20, priority=0), req("b", 900, priority=5)], "b"),  # the least urgent goes first
    ([req("a", 20, migrating=True), req("b", 900)], "b"),  # already moving
    ([req("a", 20, migrating=True)], None),
    ([req("a", 20, generated=0), req("b", 900)], "b"),  # prompt not computed yet: no KV to hand over
    ([req("b", 30), req("a", 30)], "a"),  # ties by id
])
def test_pick_migration(requests, expected):
    chosen = pick_migration(w("src", requests))
    assert (chosen.request_id if chosen else None) == expected


BIG = [req("x", 1400)]  # 88 blocks of 16 tokens: F = 12


@pytest.mark.parametrize("workers, expected", [
    ([], 0),
    ([w("a", BIG)], 0),  # 12: inside the band [10, 60]
    ([w("a", BIG), w("b", [req("y", 1600)])], 1),  # (12 - 1) / 2 < 10: add an instance
    ([w("a"), w("b")], -1),  # idle, 100 each: one can go
    ([w("a")], 0),  # ... but never the last one
    ([w("a", BIG), w("b", [req("y", 1600)]), w("c")], 0),  # (12 - 1 + 100) / 3
    ([w("a", BIG), w("b", [req("y", 1600)]), w("c", state="draining")], 1),  # a draining one does not count
    ([w("a", BIG), w("b", [req("y", 1600)]), w("c", role="prefill")], 1),  # nor a prefill worker
    ([w("a", BIG), w("b", [req("y", 1600)]), w("c", kv_total=0)], 1),  # nor one that reports no KV blocks
])
def test_scaling_advice(workers, expected):
    assert scaling_advice(workers, low=10, high=60) == expected


def test_scaling_advice_counts_the_priority_headroom():
    urgent = [w("a", [req("x", 160, priority=-1)]), w("b", [req("y", 160, priority=-1)])]  # F = 89 each
    assert scaling_advice(urgent, low=10, high=60) == -1
    assert scaling_advice(urgent, low=10, high=60, priority_headroom_blocks=85) == 1  # F = 4 each


def test_worker_view_carries_the_heartbeat_over():
    info = WorkerInfo(worker_id="d", role="decode", model="m", fingerprint="f", max_model_len=2048, running=1,
                      queued_tokens=7, capacity=4, heartbeat_s=1.0, state="draining", kv_blocks_used=3,
                      kv_blocks_total=50, block_size=16,
                      requests=[RequestProgress(request_id="r", prompt_tokens=30, generated=2, max_tokens=9,
                                                priority=1, migrating=True)])
    view = worker_view(info)
    assert (view.worker_id, view.state, view.kv_blocks_total, view.block_size, view.queued_tokens) == \
        ("d", "draining", 50, 16, 7)
    assert view.requests == (RunningRequest("r", 30, 2, 9, None, 1, migrating=True),)
