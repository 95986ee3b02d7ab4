"""tool_choice "auto" at the router: a model's own call format read back by vLLM 0.32's parser of it, whole
and streamed however the output's deltas are cut (each leg of a disaggregated or migrated request sends its
own), against what vLLM's server makes of the same output with the same parser."""

import json
import random

import pytest

from llmesh.engine.models import build_tokenizer
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import InvalidRequest
from llmesh_router.auto_tools import AutoToolParsers
from llmesh_router.openai_api import ChatCompletionRequest, Choice, ResponseShape

from .test_tools import CHAT, TIME, WEATHER

OUTPUTS = {
    "pythonic": [
        "[get_weather(city='Paris', unit='c'), get_time()]",
        "[get_weather(city='Oslo \"N\" [x]')]",
        "A plain answer, no call.",
        "[get_weather(city='Par",  # cut by max_tokens
    ],
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        'Let me look.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>',
        "A plain answer, no call.",
    ],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # (what vLLM's loader reads first)
    return path


@pytest.fixture(scope="module")
def parsers(tokenizer_dir):
    catalogue = [ServedModel(name=p, model=str(tokenizer_dir), tool_call_parser=p) for p in OUTPUTS]
    return AutoToolParsers([*catalogue, ServedModel(name="plain", model=str(tokenizer_dir))], tokenizer_dir)


def theirs(tokenizer_dir, name: str, **fields):
    """vLLM's server's request and a parser for it, as its serving code makes them."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(tokenizer_dir))
    parser_class = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, tokenizer=tokenizer)
    request = VllmRequest(**CHAT | {"model": name}, **fields)
    request = parser_class(tokenizer, request.tools).adjust_request(request)
    return request, lambda: parser_class(tokenizer, request.tools), tokenizer


def plain_calls(tool_calls) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls or ()]


@pytest.mark.parametrize("name", list(OUTPUTS))
@pytest.mark.parametrize("parallel", [True, False])
def test_calls_whole_and_streamed_are_what_vllms_parser_reads_cut_anywhere(parsers, tokenizer_dir, name, parallel):
    fields = {"tools": [WEATHER, TIME]} | ({} if parallel else {"parallel_tool_calls": False})
    their_request, their_parser, tokenizer = theirs(tokenizer_dir, name, **fields)
    body = ChatCompletionRequest(**CHAT | {"model": name}, **fields)
    assert body.auto_tools and body.tool_calling is None  # "auto": the default with tools
    rng = random.Random(3)
    for text in OUTPUTS[name]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        _, content, calls = their_parser().parse(
            text, their_request, enable_auto_tools=True, model_output_token_ids=ids
        )
        expected = [(c.name, c.arguments) for c in calls or ()][: None if parallel else 1]
        calling = parsers.calling(body)
        whole = ResponseShape(True, "id", name, tools=calling).final([Choice(text, "stop", len(ids), ids)], 3)
        choice = whole["choices"][0]
        assert plain_calls(choice["message"].get("tool_calls")) == expected
        assert choice["message"]["content"] == content
        assert choice["finish_reason"] == ("tool_calls" if expected else "stop")
        assert all(c["id"].startswith("chatcmpl-tool-") for c in choice["message"].get("tool_calls") or ())

        for _ in range(5):  # deltas of one to several tokens, as the legs of a request send them
            cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(1, 8))))
            pieces = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
            shape, parser = ResponseShape(True, "id", name, tools=parsers.calling(body)), their_parser()
            streamed: dict[int, list[str]] = {}
            shown, their_shown, done = "", "", 0
            for i, piece in enumerate(pieces):
                delta_text = tokenizer.decode(ids[: done + len(piece)])[len(tokenizer.decode(ids[:done])) :]
                done += len(piece)
                last = i == len(pieces) - 1
                event = shape.chunk_event(delta_text, "stop" if last else None, i == 0, piece, index=0)
                their = parser.parse_delta(delta_text, piece, their_request, [], finished=last)
                their_shown += (their.content or "") if their else ""
                if not event:
                    continue
                chunk = json.loads(event[6:])["choices"][0]
                shown += chunk["delta"].get("content") or ""
                for call in chunk["delta"].get("tool_calls") or ():
                    if call.get("id"):
                        streamed[call["index"]] = [call["function"]["name"], ""]
                    streamed[call["index"]][1] += call["function"].get("arguments") or ""
                if last:
                    assert chunk["finish_reason"] == ("tool_calls" if streamed else "stop")
            assert shown == their_shown
            if not text.endswith("Par"):  # (a call cut short streams what it had)
                assert [tuple(c) for c in streamed.values()] == expected, pieces


def test_a_parser_adjusts_the_requests_sampling_as_vllms_server_does(parsers):
    """Hermes keeps special tokens (its tags may be ones); pythonic changes nothing."""
    body = ChatCompletionRequest(**CHAT | {"model": "hermes"}, tools=[WEATHER])
    assert parsers.calling(body).sampling_update == {"skip_special_tokens": False}
    body = ChatCompletionRequest(**CHAT | {"model": "pythonic"}, tools=[WEATHER], structured_outputs={"regex": "x"})
    assert parsers.calling(body).sampling_update == {"skip_special_tokens": True}  # (its constraint kept)


def test_auto_without_a_parser_is_vllms_400_naming_the_setting_and_a_bad_parser_stops_the_start(parsers, tokenizer_dir):
    for choice in (None, "auto"):
        body = ChatCompletionRequest(**CHAT | {"model": "plain"}, tools=[WEATHER], tool_choice=choice)
        with pytest.raises(InvalidRequest, match="tool_call_parser") as refused:
            parsers.calling(body)
        assert refused.value.param == "tool_choice"
    assert not ChatCompletionRequest(**CHAT | {"model": "plain"}, tools=[WEATHER], tool_choice="none").auto_tools
    with pytest.raises(ValueError, match="'odd': tool_call_parser 'nope'"):
        AutoToolParsers([ServedModel(name="odd", model=str(tokenizer_dir), tool_call_parser="nope")], tokenizer_dir)
