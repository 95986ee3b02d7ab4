"""Span ids stay unique across processes that seed `random` alike (vLLM seeds every engine process); spans are
recorded only where they have somewhere to go."""

import random
import subprocess
import sys

from llmesh.wire.telemetry import _SystemRandomIds


def test_span_and_trace_ids_do_not_follow_the_random_modules_seed():
    ids = _SystemRandomIds()
    drawn = []
    for _ in range(2):
        random.seed(0)  # as vLLM does in each engine process
        drawn.append((ids.generate_span_id(), ids.generate_trace_id()))
    assert drawn[0][0] != drawn[1][0] and drawn[0][1] != drawn[1][1]
    assert all(0 < s < 2**64 and 0 < t < 2**128 for s, t in drawn)


def test_spans_are_not_recorded_where_they_have_nowhere_to_go_and_a_requests_trace_context_goes_on():
    # in a process of its own: the global tracer provider is set once a process
    probe = """
from opentelemetry import trace
from llmesh.wire import telemetry
telemetry.setup_tracing("probe", otlp_endpoint=None, trace_dir=None)
came = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
span = telemetry.tracer("probe").start_span("request", context=telemetry.extract(came))
assert not span.is_recording()
assert telemetry.inject(trace.set_span_in_context(span)) == came
"""
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
