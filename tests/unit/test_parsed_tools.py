"""Tool calls at the router for a model with a parser of its own call format: every tool choice read back by
vLLM 0.32's parser, whole and streamed however the output's deltas are cut (each leg of a disaggregated or
migrated request sends its own), against what vLLM's server makes of the same output with the same parser."""

import json
import random

import pytest

from llmesh.engine.models import build_tokenizer
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import InvalidRequest
from llmesh_router.openai_api import ChatCompletionRequest, Choice, ResponseShape
from llmesh_router.parsed_tools import ToolParsers

from .test_tools import CHAT, TIME, WEATHER

NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a model's outputs under each tool choice: its parser's format, or JSON where the parser reads JSON for a
# forced call (pythonic)
OUTPUTS = {
    ("pythonic", "auto"): [
        "[get_weather(city='Paris', unit='c'), get_time()]",
        "[get_weather(city='Oslo \"N\" [x]')]",
        "A plain answer, no call.",
        "[get_weather(city='Par",  # cut by max_tokens
    ],
    ("pythonic", "required"): [
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
        '[{"name": "get_weather", "parameters": {"city": "Par',
    ],
    ("pythonic", "named"): ['{"city": "Paris", "unit": "c"}'],
    ("hermes", "auto"): [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        'Let me look.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>',
        "A plain answer, no call.",
    ],
    ("hermes", "required"): [
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>',
    ],
    ("hermes", "named"): ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'],
}
# parsers of the sampling check besides those of OUTPUTS: mistral constrains a forced call as JSON of its own
# form; dots leaves it unconstrained, read in its own format
PARSERS = sorted({name for name, _ in OUTPUTS} | {"mistral", "dots"})
CALL_TOKENS = ["[TOOL_CALLS]", "<dots_function_call>", "</dots_function_call>"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)  # with the tokens two more parsers look for
    tokenizer.add_tokens(CALL_TOKENS, special_tokens=True)
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # (what vLLM's loader reads first)
    return path


@pytest.fixture(scope="module")
def parsers(tokenizer_dir):
    catalogue = [ServedModel(name=p, model=str(tokenizer_dir), tool_call_parser=p) for p in PARSERS]
    return ToolParsers([*catalogue, ServedModel(name="plain", model=str(tokenizer_dir))], tokenizer_dir)


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


@pytest.mark.parametrize("name, choice", list(OUTPUTS))
@pytest.mark.parametrize("parallel", [True, False])
def test_calls_whole_and_streamed_are_what_vllms_server_reads_cut_anywhere(
    parsers, tokenizer_dir, name, choice, parallel
):
    fields = {"tools": [WEATHER, TIME], "tool_choice": NAMED if choice == "named" else choice}
    fields |= {} if parallel else {"parallel_tool_calls": False}
    their_request, their_parser, tokenizer = theirs(tokenizer_dir, name, **fields)
    body = ChatCompletionRequest(**CHAT | {"model": name}, **fields)
    assert body.tool_calling is None if choice == "auto" else body.tool_calling is not None  # (theirs without a parser)
    rng = random.Random(3)
    for text in OUTPUTS[name, choice]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        # vLLM's server (chat_completion_full_generator): the parser's reading, the message and finish reason
        _, content, calls = their_parser().parse(
            text, their_request, enable_auto_tools=True, model_output_token_ids=ids
        )
        expected = [(c.name, c.arguments) for c in calls or ()][: None if parallel else 1]
        if choice == "auto":
            finish = "tool_calls" if expected else "stop"
        else:
            content, finish = content or "", "tool_calls" if choice == "required" else "stop"
        whole = ResponseShape(True, "id", name, tools=parsers.calling(body)).final(
            [Choice(text, "stop", len(ids), ids)], 3
        )
        answer = whole["choices"][0]
        assert plain_calls(answer["message"].get("tool_calls")) == expected
        assert (answer["message"]["content"], answer["finish_reason"]) == (content, finish)
        assert all(c["id"].startswith("chatcmpl-tool-") for c in answer["message"].get("tool_calls") or ())

        # deltas of one to several tokens, as the legs of a request send them (whole characters: the workers'
        # detokenizers hold a character's first bytes back)
        boundaries = [k for k in range(1, len(ids)) if text.startswith(tokenizer.decode(ids[:k]))]
        for _ in range(5):
            cuts = sorted(rng.sample(boundaries, k=min(len(boundaries), rng.randint(1, 8))))
            pieces = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
            shape, parser = ResponseShape(True, "id", name, tools=parsers.calling(body)), their_parser()
            ours: dict[int, list[str]] = {}
            their_calls: dict[int, list[str]] = {}
            shown, their_shown, done = "", "", 0
            for i, piece in enumerate(pieces):
                delta_text = tokenizer.decode(ids[: done + len(piece)])[len(tokenizer.decode(ids[:done])) :]
                done += len(piece)
                last = i == len(pieces) - 1
                event = shape.chunk_event(delta_text, "stop" if last else None, i == 0, piece, index=0)
                their = parser.parse_delta(delta_text, piece, their_request, [], finished=last)
                if their:  # (vLLM's server streams these, less calls past the first without parallel calls)
                    their_shown += their.content or ""
                    accumulate(their_calls, [c.model_dump() for c in their.tool_calls if parallel or c.index == 0])
                if not event:
                    continue
                chunk = json.loads(event[6:])["choices"][0]
                shown += chunk["delta"].get("content") or ""
                accumulate(ours, chunk["delta"].get("tool_calls"))
                if last:
                    called = bool(their_calls) and choice != "named"  # (vLLM: tools streamed, not a named call)
                    assert chunk["finish_reason"] == ("tool_calls" if called else "stop")
            assert (shown, ours) == (their_shown, their_calls), pieces
            if not text.endswith("Par"):  # (a call cut short streams what it had)
                assert [tuple(c) for c in ours.values()] == expected, pieces


def accumulate(calls: dict[int, list[str]], deltas) -> None:
    """A client's reading of streamed call deltas: a call's first (with its id) names it."""
    for call in deltas or ():
        if call.get("id"):
            calls[call["index"]] = [call["function"]["name"], ""]
        calls[call["index"]][1] += call["function"].get("arguments") or ""


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("choice", ["auto", "required", "named"])
@pytest.mark.parametrize("response_format", [None, {"type": "json_object"}])
def test_the_engines_constraint_and_special_tokens_are_vllms_servers(
    parsers, tokenizer_dir, name, choice, response_format
):
    """What the engines get is what vLLM's server gives its engine (`to_sampling_params` of the request its
    parser adjusted): the parser's constraint, or the request's own where the parser sets none."""
    fields = {"tools": [WEATHER, TIME], "tool_choice": NAMED if choice == "named" else choice}
    fields |= {"response_format": response_format} if response_format else {}
    their_request, _, _ = theirs(tokenizer_dir, name, **fields)
    from vllm.sampling_params import StructuredOutputsParams

    their = their_request.to_sampling_params(16, {})
    update = parsers.calling(ChatCompletionRequest(**CHAT | {"model": name}, **fields)).sampling_update
    assert update.keys() == {"skip_special_tokens", "structured"}
    assert update["skip_special_tokens"] == their.skip_special_tokens
    structured = update["structured"] and StructuredOutputsParams(**update["structured"])  # (as the workers make it)
    assert structured == their.structured_outputs


def test_a_parser_adjusts_the_requests_sampling_as_vllms_server_does(parsers):
    """Hermes keeps special tokens (its tags may be ones); pythonic changes nothing."""
    body = ChatCompletionRequest(**CHAT | {"model": "hermes"}, tools=[WEATHER])
    assert parsers.calling(body).sampling_update == {"skip_special_tokens": False, "structured": None}
    body = ChatCompletionRequest(**CHAT | {"model": "pythonic"}, tools=[WEATHER], structured_outputs={"regex": "x"})
    assert parsers.calling(body).sampling_update == {"skip_special_tokens": True, "structured": body.structured()}
    assert body.structured()["regex"] == "x"  # (the request's own constraint kept)


def test_auto_without_a_parser_is_vllms_400_naming_the_setting_and_a_bad_parser_stops_the_start(parsers, tokenizer_dir):
    for choice in (None, "auto"):
        body = ChatCompletionRequest(**CHAT | {"model": "plain"}, tools=[WEATHER], tool_choice=choice)
        with pytest.raises(InvalidRequest, match="tool_call_parser") as refused:
            parsers.calling(body)
        assert refused.value.param == "tool_choice"
    assert not ChatCompletionRequest(**CHAT | {"model": "plain"}, tools=[WEATHER], tool_choice="none").auto_tools
    with pytest.raises(ValueError, match="'odd': tool_call_parser 'nope'"):
        ToolParsers([ServedModel(name="odd", model=str(tokenizer_dir), tool_call_parser="nope")], tokenizer_dir)
