"""The llmesh vLLM plugin reads the cores an engine computes on in vLLM's own syntax."""

import pytest

from llmesh.engine.vllm_plugin import engine_cores


@pytest.mark.parametrize(
    ("bind", "cores"),
    [
        ("1", {1}),
        ("0-3", {0, 1, 2, 3}),
        ("0,2", {0, 2}),
        ("0|1", {0, 1}),
        ("0-1|4-5", {0, 1, 4, 5}),
        ("auto", set()),
        ("nobind", set()),
        ("", set()),
        ("0-", set()),
    ],
)
def test_engine_cores_in_vllms_thread_binding_syntax(bind, cores):
    assert engine_cores(bind) == cores
