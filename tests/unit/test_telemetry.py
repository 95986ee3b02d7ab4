"""Span ids stay unique across processes that seed `random` alike (vLLM seeds every engine process)."""

import random

from llmesh.wire.telemetry import _SystemRandomIds


def test_span_and_trace_ids_do_not_follow_the_random_modules_seed():
    ids = _SystemRandomIds()
    drawn = []
    for _ in range(2):
        random.seed(0)  # as vLLM does in each engine process
        drawn.append((ids.generate_span_id(), ids.generate_trace_id()))
    assert drawn[0][0] != drawn[1][0] and drawn[0][1] != drawn[1][1]
    assert all(0 < s < 2**64 and 0 < t < 2**128 for s, t in drawn)
