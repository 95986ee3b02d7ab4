"""Tool calling at the router against vLLM 0.32's own functions: the constraint, a whole output's calls, the
streamed deltas, the errors, and the messages a history sends back."""

import asyncio
import copy
import json
import random

import pytest
from pydantic import ValidationError

from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import TokenDelta
from llmesh_router.schemas import ChatCompletionRequest
from llmesh_router.shapes import Choice, ResponseShape
from llmesh_router.tools import _required_deltas

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "$defs": {"unit": {"enum": ["c", "f"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**CHAT, **fields)


def vllm_request(**fields):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

    return VllmRequest(**CHAT, **copy.deepcopy(fields))


@pytest.mark.parametrize("parallel", [True, False, None])
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}, {"function": {"name": "get_time"}}],
)
def test_the_constraint_is_vllms(choice, parallel):
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    fields = {"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel}
    theirs = vllm_request(**fields)
    expected = get_json_schema_from_tools(theirs.tool_choice, theirs.tools, theirs.parallel_tool_calls)
    assert request(**fields).sampling().structured == {"json": expected}


def test_a_tool_choice_replaces_response_format_and_a_named_one_refuses_structured_outputs_as_vllm_does():
    fmt = {"type": "json_object"}
    got = request(tools=[TIME], tool_choice="required", response_format=fmt).sampling().structured
    assert got is not None and got["json"]["type"] == "array"
    assert request(tools=[TIME], tool_choice="none", response_format=fmt).sampling().structured == {"json_object": True}
    with pytest.raises(InvalidRequest, match="either use constraints for structured outputs or tools"):
        request(tools=[TIME], tool_choice={"function": {"name": "get_time"}}, structured_outputs={"regex": "a"})


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"tools": []}, "tools", "must not be an empty array"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": [TIME], "tool_choice": {"function": {"name": "nope"}}}, "tool_choice", "does not match any"),
    ],
)
def test_bad_tool_fields_are_vllms_errors(fields, param, message):
    with pytest.raises(InvalidRequest, match=message) as error:
        request(**fields)
    assert error.value.param == param


def test_malformed_tools_and_choices_are_400s():
    for bad in (
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        {"tools": [TIME], "tool_choice": "any"},
        {"tools": [TIME], "tool_choice": {"function": {}}},
    ):
        with pytest.raises(ValidationError):
            request(**bad)


def test_none_keeps_text_and_hands_the_tools_to_the_template():
    chat = request(tools=[WEATHER], tool_choice="none")
    assert chat.tool_calling is None and chat.sampling().structured is None
    (prompt,) = chat.inputs()
    assert prompt.tools == [t.model_dump() for t in vllm_request(tools=[WEATHER], tool_choice="none").tools]
    assert request().inputs()[0].tools is None


REQUIRED_OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]',
    '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Oslo \\"N\\" [x] {y}"}}]',
    '[ {"parameters": {"city": "Köln"}, "name": "get_weather"} ]',
    '[{"name": "get_weather", "parameters": {"city": "Par',  # cut by max_tokens
    "[]",
    "not json",
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_a_whole_required_outputs_calls_are_vllms(text):
    from pydantic import TypeAdapter
    from vllm.entrypoints.generate.base.protocol import FunctionDefinition

    try:  # vLLM's reading (parser/abstract_parser.py, _extract_tool_calls)
        read = TypeAdapter(list[FunctionDefinition]).validate_json(text)
    except ValidationError:
        read = []
    expected = [(f.name, json.dumps(f.parameters, ensure_ascii=False)) for f in read]
    calling = request(tools=[WEATHER, TIME], tool_choice="required").tool_calling
    calls = calling.calls(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS[:4])
def test_streamed_required_calls_are_vllms_at_every_cut(text):
    from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

    def plain(deltas):
        return [
            {"index": d["index"], "name": d["function"].get("name"), "arguments": d["function"]["arguments"]}
            for d in deltas
        ]

    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        previous = ""
        for end in [*cuts, len(text)]:
            current = text[:end]
            theirs, _ = extract_required_tool_call_streaming(
                previous_text=previous, current_text=current, tool_call_idx=None, tool_call_id_type="random"
            )
            expected = [
                {"index": t.index, "name": t.function.name, "arguments": t.function.arguments}
                for t in (theirs.tool_calls if theirs else [])
            ]
            assert plain(_required_deltas(previous, current)) == expected, (previous, current)
            previous = current


def test_streamed_chunks_add_up_to_the_whole_answer():
    """Named and required, streamed token by token: the client's accumulated calls are the whole answer's,
    the first delta of a call carries its id, type and name, and the finish reasons are OpenAI's."""
    cases = [
        ({"function": {"name": "get_weather"}}, '{"city": "Paris"}', "stop"),
        ("required", REQUIRED_OUTPUTS[1], "tool_calls"),
    ]
    for choice, text, finish in cases:
        calling = request(tools=[WEATHER, TIME], tool_choice=choice).tool_calling
        whole = ResponseShape(True, "id", "m", reading=calling).final([Choice(text, "stop", 9)], 3)
        message = whole["choices"][0]["message"]
        assert message["content"] == "" and whole["choices"][0]["finish_reason"] == finish
        shape = ResponseShape(True, "id", "m", reading=calling)
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        events = [
            shape.chunk_event(
                TokenDelta(text=p, token_ids=[], finish_reason="stop" if i == len(pieces) - 1 else None), first=i == 0
            )
            for i, p in enumerate(pieces)
        ]
        chunks = [json.loads(event[6:])["choices"][0] for event in events if event]
        assert all(chunk["delta"] or chunk["finish_reason"] for chunk in chunks)  # (nothing revealed: no event)
        if choice == "required":
            assert b"" in events  # ('[{"n' reveals nothing)
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for delta in chunk["delta"].get("tool_calls", ()):
                if "id" in delta:
                    assert delta["index"] not in calls and delta["function"]["name"]
                    calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
        assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == finish
        # (a "required" call's arguments stream as generated; the whole answer's are re-serialized, as vLLM's)
        streamed = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
        assert streamed == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
        ]
        if choice != "required":
            assert calls[0]["arguments"] == message["tool_calls"][0]["function"]["arguments"] == text


def test_parallel_tool_calls_false_keeps_the_first_call():
    calling = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_calling
    assert [c["function"]["name"] for c in calling.calls(REQUIRED_OUTPUTS[1])] == ["get_time"]


def test_a_history_with_calls_and_their_results_reaches_the_template_as_vllm_hands_it_over():
    chat = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"X"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny.", "tool_calls": []},
        ],
    )
    messages = [m.model_dump(exclude_none=True) for m in chat.inputs()[0].messages]
    assert messages == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny."},  # an empty list of calls: none (vLLM drops it)
    ]


def test_an_embedded_model_built_earlier_gets_the_chat_template_that_renders_tools(tmp_path):
    from llmesh.engine.models import BUILD, BUILD_FILE, CHAT_TEMPLATE, resolve_model

    built = tmp_path / "tiny-llama"
    built.mkdir()
    (built / "config.json").write_text("{}")
    (built / BUILD_FILE).write_text(f'{{"build": {BUILD}}}')  # (this version's build: only its template is old)
    (built / "chat_template.jinja").write_text("{{ messages }}")  # an earlier version's
    assert resolve_model("llmesh/tiny-llama", tmp_path) == str(built)
    assert (built / "chat_template.jinja").read_text() == CHAT_TEMPLATE and "tools" in CHAT_TEMPLATE


def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_them():
    import jinja2

    from llmesh.engine.prompts import PromptRenderer
    from llmesh.wire.messages import ChatMessage, PrefillRequest, SamplingOptions

    class Tokenizer:  # a template's raise_exception, as HF's templates raise it
        def __len__(self):
            return 100

        def apply_chat_template(self, messages, **kwargs):
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    prompts = PromptRenderer(Tokenizer(), 64)
    req = PrefillRequest(
        request_id="r",
        model="m",
        messages=[ChatMessage(role="assistant", content="x")],
        sampling=SamplingOptions(),
        deadline=0,
    )
    with pytest.raises(InvalidRequest, match="roles must alternate") as error:
        asyncio.run(prompts.prompt_token_ids(req))
    assert error.value.param == "messages" and error.value.http_status == 400
