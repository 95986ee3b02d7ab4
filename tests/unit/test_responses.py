"""OpenAI's Responses API over the chat path: requests as chat completions (checked against vLLM's own conversion),
output items and stream events from the chat's objects, and stored responses in a real Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmesh.wire.errors import InvalidRequest, ResponseNotFound, ServiceUnavailable
from llmesh.wire.messages import TokenDelta
from llmesh_router.responses import ResponsesRequest, ResponsesShape, ResponseStore
from llmesh_router.shapes import Choice
from tests.unit.test_openai_api import _router

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# a conversation with every kind of input item, as a client sends one back (ids and statuses included)
ITEMS: list[dict[str, Any]] = [
    {"role": "developer", "content": "Answer briefly."},
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}],
    },
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Call the tool."}],
    },
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    },
    {
        "type": "function_call",
        "id": "fc_2",
        "call_id": "call_2",
        "name": "get_weather",
        "arguments": '{"city": "Lyon"}',
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Sunny, and rain in Lyon.", "annotations": []}],
    },
    {"role": "user", "content": "Thanks"},
]


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi"} | fields)


def _normalised(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message's fields that reach its template, text parts joined (as the chat path joins them)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or ()
    ]
    fields = {
        "role": message["role"],
        "content": content,
        "tool_calls": calls or None,
        "tool_call_id": message.get("tool_call_id"),
        "reasoning": message.get("reasoning"),
    }
    return {k: v for k, v in fields.items() if v is not None}


def test_input_items_become_the_chat_messages_vllms_server_makes_of_them():
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VllmRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    vllm = VllmRequest.model_validate({"model": "m", "input": ITEMS, "instructions": "Be kind."})
    expected = construct_input_messages(request_instructions=vllm.instructions, request_input=vllm.input)
    chat = request(input=ITEMS, instructions="Be kind.").chat([])
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [_normalised(m) for m in got] == [_normalised(dict(m)) for m in expected]
    # one assistant turn: its reasoning, both calls and the text that followed the tools' outputs apart
    assert [m["role"] for m in got] == ["system", "developer", "user", "assistant", "tool", "tool", "assistant", "user"]


def test_a_request_is_the_chat_completion_of_the_same_fields():
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}]
    chat = request(
        input="now",
        instructions="Be kind.",
        max_output_tokens=7,
        temperature=0,
        top_p=0.5,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
        reasoning={"effort": "low"},
        top_logprobs=3,
        include=["message.output_text.logprobs"],
        seed=5,
        top_k=4,
        stop=["END"],
        cache_salt="tenant",
        unknown_field="ignored",
    ).chat(history)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be kind."),  # the earlier instructions do not carry over (OpenAI's rule)
        ("user", "earlier"),
        ("assistant", "answer"),
        ("user", "now"),
    ]
    options = chat.sampling()
    assert (options.max_tokens, options.temperature, options.top_p, options.seed, options.top_k) == (7, 0, 0.5, 5, 4)
    assert options.stop == ["END"] and chat.cache_salt == "tenant" and chat.logprob_count == 3
    assert chat.tool_calling is not None and chat.tool_calling.function == "get_weather"
    assert chat.tools is not None and chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.template_kwargs()["reasoning_effort"] == "low"
    assert request(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}).chat(
        []
    ).sampling().structured == {"json": {"type": "object"}}
    plain = request().chat([])
    assert plain.logprob_count is None and plain.tools is None and plain.sampling().max_tokens is None
    assert request(top_logprobs=3).chat([]).logprob_count is None  # (logprobs come where `include` asks for them)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"background": True}, "background", "background responses are not supported"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "reusable prompts are not supported"),
        ({"conversation": "conv_1"}, "conversation", "conversations are not supported"),
        (
            {"tools": [WEATHER, {"type": "web_search"}]},
            "tools.1",
            "only function tools are supported, not 'web_search'",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0", "input items of type 'item_reference'"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}, "input.0", "encrypted"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "only text content parts"),
        ({"include": ["file_search_call.results", "x"]}, "include", "unknown values ['x']"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
        ({"tool_choice": "required"}, "tool_choice", "`tool_choice` needs `tools`"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"input": []}, "input", "at least 1 item"),  # (the chat's messages, named as the request names them)
        ({"vllm_xargs": {"a": 1}}, "vllm_xargs", "custom logits processors"),  # (the chat's refusal, passed on)
        ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ],
)
def test_what_the_mesh_does_not_do_is_refused_by_name(fields, param, words):
    from pydantic import ValidationError

    from llmesh_router.schemas import validation_error

    try:
        request(**fields).chat([])
    except ValidationError as exc:
        error = validation_error([dict(e) for e in exc.errors()])
    except InvalidRequest as exc:
        error = exc
    else:
        raise AssertionError(f"{fields} accepted")
    assert error.param is not None and error.param.startswith(param) and words in error.message, (
        error.param,
        error.message,
    )


def _events(stream: bytes) -> list[dict[str, Any]]:
    """A stream's events, each checked to name its type twice (SSE's `event:` and the data's)."""
    events = []
    for block in stream.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def _streamed(shape: ResponsesShape, deltas: list[TokenDelta], cached: int = 0) -> list[dict[str, Any]]:
    out = b"".join(shape.chunk_event(d, first=i == 0) for i, d in enumerate(deltas))
    return _events(out + shape.stream_end(5, deltas[-1].completion_tokens, cached))


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "call_id", "created_at")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _deltas(texts: list[str], finish_reason: str) -> list[TokenDelta]:
    return [
        TokenDelta(
            text=t,
            token_ids=[i],
            completion_tokens=i + 1,
            prompt_tokens=5,
            finish_reason=finish_reason if i == len(texts) - 1 else None,
            logprobs=[[(i, -0.5, t), (99, -1.5, "alt")]],
        )
        for i, t in enumerate(texts)
    ]


@pytest.mark.parametrize("finish_reason, status", [("stop", "completed"), ("length", "incomplete")])
def test_a_streamed_response_ends_as_the_whole_one_with_its_events_in_openais_order(finish_reason, status):
    body = request(top_logprobs=1, include=["message.output_text.logprobs"], metadata={"k": "v"})
    deltas = _deltas(["Hel", "lo", " world"], finish_reason)
    whole = ResponsesShape(body, "resp_1", None).final([Choice.of(deltas)], 5, 2)
    events = _streamed(ResponsesShape(body, "resp_1", None), deltas, 2)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{status}",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello world"
    assert events[4]["logprobs"] == [
        {"token": "Hel", "logprob": -0.5, "top_logprobs": [{"token": "Hel", "logprob": -0.5}]}
    ]
    ended = events[-1]["response"]
    assert _without_ids(ended) == _without_ids(whole)
    assert whole["status"] == status and whole["output"][0]["status"] == status
    assert whole["incomplete_details"] == ({"reason": "max_output_tokens"} if status == "incomplete" else None)
    (part,) = whole["output"][0]["content"]
    assert part["text"] == "Hello world" and [lp["token"] for lp in part["logprobs"]] == ["Hel", "lo", " world"]
    assert whole["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    assert (whole["metadata"], whole["top_logprobs"], whole["temperature"], whole["store"]) == (
        {"k": "v"},
        1,
        1.0,
        True,
    )


def test_a_stream_that_fails_midway_ends_with_response_failed_and_its_error():
    from llmesh.wire.errors import WorkerLost

    shape = ResponsesShape(request(), "resp_1", None)
    opening = shape.chunk_event(TokenDelta(text="Hi", token_ids=[]), first=True)
    events = _events(opening + shape.stream_error(WorkerLost("the decode worker is gone")))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == len(events) - 1
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "worker_lost", "message": "the decode worker is gone"}


def test_forced_calls_are_function_call_items_whole_and_streamed():
    body = request(tools=[WEATHER, WEATHER | {"name": "get_time"}], tool_choice="required")
    calls = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    pieces = [calls[i : i + 7] for i in range(0, len(calls), 7)]
    deltas = _deltas(pieces, "stop")
    reading = body.chat([]).tool_calling
    whole = ResponsesShape(body, "resp_1", reading).final([Choice.of(deltas)], 5)
    events = _streamed(ResponsesShape(body, "resp_1", reading), deltas)
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in whole["output"]] == [
        ("function_call", "get_weather", {"city": "Paris"}),
        ("function_call", "get_time", {}),
    ]
    assert _without_ids(events[-1]["response"]["output"]) == _without_ids(whole["output"])
    kinds = [e["type"] for e in events if e["type"] != "response.function_call_arguments.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        *["response.output_item.added", "response.function_call_arguments.done", "response.output_item.done"] * 2,
        "response.completed",
    ]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(a["id"], a["call_id"], a["arguments"], a["status"]) for a in added] == [
        (d["id"], d["call_id"], "", "in_progress") for d in done
    ]


def test_a_response_continues_as_a_conversation_and_the_next_sees_its_output():
    from llmesh_router.responses import conversation

    body = request(input=ITEMS[:2], instructions="first instructions")
    deltas = _deltas(["It is ", "sunny."], "stop")
    whole = ResponsesShape(body, "resp_1", None).final([Choice.of(deltas)], 5)
    kept = conversation([], body, whole)
    assert kept == [*body.input_messages(), {"role": "assistant", "content": "It is sunny."}]
    following = request(input="And Lyon?", instructions="second").chat(kept)
    assert [m.role for m in following.messages] == ["system", "developer", "user", "assistant", "user"]
    assert following.messages[0].content == "second"


async def test_stored_responses_are_read_continued_and_deleted_by_their_key_alone(redis_url):
    from llmesh_router.auth import KeyRing

    store = ResponseStore(redis_url, ttl_s=60)
    keys = KeyRing.load("sk-a alice,sk-b bob", None)
    dispatcher, client = _router([[1], [2]], keys=keys, response_store=store)
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("sk-a", "sk-b"))
    async with client:
        first = await client.post(
            "/v1/responses", json={"model": "m", "input": "hi", "instructions": "Be kind."}, headers=alice
        )
        assert first.status_code == 200, first.text
        made = first.json()
        assert (
            made["id"].startswith("resp_") and made["store"] is True and made["output"][0]["content"][0]["text"] == "xx"
        )
        assert (await client.get(f"/v1/responses/{made['id']}", headers=alice)).json() == made
        listed = (await client.get(f"/v1/responses/{made['id']}/input_items", headers=alice)).json()
        assert [(i["role"], i["content"][0]["text"]) for i in listed["data"]] == [("user", "hi")]
        too_many = await client.get(f"/v1/responses/{made['id']}/input_items?limit=101", headers=alice)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "limit"
        missing = await client.get(f"/v1/responses/{made['id']}", headers=bob)  # another key's: not found
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"

        streamed = await client.post(
            "/v1/responses",
            json={"model": "m", "input": "more", "previous_response_id": made["id"], "stream": True},
            headers=alice,
        )
        ended = _events(streamed.content)[-1]["response"]
        assert ended["previous_response_id"] == made["id"]
        messages = [(m.role, m.content) for m in dispatcher.requests[-1].messages]
        assert messages == [("user", "hi"), ("assistant", "xx"), ("user", "more")]  # (instructions not carried over)
        assert (await client.get(f"/v1/responses/{ended['id']}", headers=alice)).json() == ended

        refused = await client.post(
            "/v1/responses", json={"model": "m", "input": "x", "previous_response_id": made["id"]}, headers=bob
        )
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "previous_response_id"
        assert (await client.delete(f"/v1/responses/{made['id']}", headers=bob)).status_code == 404
        deleted = await client.delete(f"/v1/responses/{made['id']}", headers=alice)
        assert deleted.json() == {"id": made["id"], "object": "response.deleted", "deleted": True}
        assert (await client.get(f"/v1/responses/{made['id']}", headers=alice)).status_code == 404

        unstored = await client.post("/v1/responses", json={"model": "m", "input": "x", "store": False}, headers=alice)
        assert unstored.json()["store"] is False
        assert (await client.get(f"/v1/responses/{unstored.json()['id']}", headers=alice)).status_code == 404
    await store.aclose()


def test_input_items_are_listed_with_their_ids_and_paged_as_openai_pages_them():
    from llmesh_router.responses import page

    items = request(input=ITEMS).input_items()
    assert [i["type"] for i in items] == [i.get("type", "message") for i in ITEMS]
    assert [i["id"] for i in items if i["id"] in ("rs_1", "fc_1", "fc_2", "msg_1")] == ["rs_1", "fc_1", "fc_2", "msg_1"]
    assert (
        items[0]["id"].startswith("msg_") and items[5]["id"].startswith("fco_") and len({i["id"] for i in items}) == 9
    )
    assert (
        items[0]["content"] == [{"type": "input_text", "text": "Answer briefly."}] and items[0]["status"] == "completed"
    )
    assert items[-2]["content"][0]["type"] == "output_text"  # (an assistant's)
    (text,) = request(input="hi").input_items()
    assert (text["role"], text["content"]) == ("user", [{"type": "input_text", "text": "hi"}])

    ids = [i["id"] for i in items]
    newest = page(items, None, 4, "desc")
    assert [i["id"] for i in newest["data"]] == ids[::-1][:4] and newest["has_more"] is True
    assert (newest["first_id"], newest["last_id"]) == (ids[-1], ids[-4])
    rest = page(items, newest["last_id"], 20, "desc")
    assert [i["id"] for i in rest["data"]] == ids[::-1][4:] and rest["has_more"] is False
    assert [i["id"] for i in page(items, ids[6], 5, "asc")["data"]] == ids[7:]
    with pytest.raises(InvalidRequest, match="no item 'nope'"):
        page(items, "nope", 5, "asc")


async def test_requests_by_id_or_to_unknown_paths_count_under_one_label_each():
    _, client = _router([[1]])
    async with client:
        for i in range(3):
            assert (await client.get(f"/v1/responses/resp_{i}")).status_code == 404
            assert (await client.get(f"/scan/{i}")).status_code == 404
        text = (await client.get("/metrics")).text
    assert 'llmesh_requests_total{endpoint="/v1/responses/{response_id}",status="404"} 3.0' in text
    assert 'llmesh_requests_total{endpoint="unmatched",status="404"} 3.0' in text
    assert "resp_0" not in text and "/scan/" not in text


async def test_without_redis_nothing_is_stored_and_a_redis_away_fails_only_what_needs_it(redis_url):
    _, client = _router([[1]])  # no store: as vLLM's server by default
    async with client:
        made = (await client.post("/v1/responses", json={"model": "m", "input": "hi"})).json()
        assert made["store"] is False
        resp = await client.post("/v1/responses", json={"model": "m", "input": "x", "previous_response_id": made["id"]})
        assert resp.status_code == 404 and "stores none" in resp.json()["error"]["message"]

    away = ResponseStore("redis://127.0.0.1:1/0", ttl_s=60, timeout_s=0.2)
    await away.keep({"id": "resp_x", "output": []}, [], [], "")  # logged; the answer still goes out
    with pytest.raises(ServiceUnavailable):
        await away.record("resp_x", "")
    await away.aclose()

    brief = ResponseStore(redis_url, ttl_s=0.05)
    await brief.keep({"id": "resp_brief", "output": []}, [], [], "")
    assert (await brief.record("resp_brief", ""))["response"]["id"] == "resp_brief"
    import asyncio

    await asyncio.sleep(0.2)
    with pytest.raises(ResponseNotFound):
        await brief.record("resp_brief", "")
    await brief.aclose()
