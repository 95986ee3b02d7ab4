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
