import json

import pytest

from llmesh_router.openai_api import ResponseShape, sse

TEXTS = ["", "plain", 'quote " and \\ backslash', "line\nbreak\ttab", "ünïcødé ✓ 🚀", "\x00 nul", '"\\u0000"']


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", ["m", 'odd "model"\x00 \\u0000'])
def test_chunk_event_renders_exactly_the_chunk(chat, model):
    shape = ResponseShape(chat, "req-1", model)
    for first in (True, False):
        for finish_reason in (None, "stop", "length"):
            for text in TEXTS:  # each (finish_reason, first) renders from the cached template after its first text
                event = shape.chunk_event(text, finish_reason, first)
                assert event == sse(shape.chunk(text, finish_reason, first))
                assert json.loads(event.removeprefix(b"data: "))["choices"][0]["finish_reason"] == finish_reason


@pytest.mark.parametrize("field, value", [("seed", 2**63), ("priority", -2**63 - 1), ("max_tokens", 2**63),
                                          ("prompt", [1, 2**64])])
def test_integers_beyond_what_the_bus_carries_are_refused_at_the_door(field, value):
    """(Found by schemathesis: a 2**64 seed reached MessagePack and answered 500.)"""
    from pydantic import ValidationError

    from llmesh_router.openai_api import CompletionRequest

    with pytest.raises(ValidationError):
        CompletionRequest(**{"model": "m", "prompt": "hi", field: value})
    CompletionRequest(**{"model": "m", "prompt": "hi", field: value // 2 if isinstance(value, int) else [1, 2**62]})


def test_a_message_with_an_integer_beyond_64_bits_is_a_bad_message():
    from llmesh.errors import BadMessage
    from llmesh.messages import SamplingOptions, encode

    with pytest.raises(BadMessage, match="beyond 64 bits"):
        encode(SamplingOptions(max_tokens=1, seed=2**70))
