"""A chat's output at the router for a model with parsers of its own formats: tool calls under every tool
choice, and reasoning, read back by vLLM 0.32's parsers, whole and streamed however the output's deltas are
cut (each leg of a disaggregated or migrated request sends its own), against what vLLM's server makes of the
same output with the same parsers."""

import json
import random

import pytest

from llmesh.engine.models import build_tokenizer
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import TokenDelta
from llmesh_router.parsed_output import OutputParsers
from llmesh_router.schemas import ChatCompletionRequest
from llmesh_router.shapes import Choice, ResponseShape

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
REASONING = ["deepseek_r1", "qwen3"]  # reasoning parsers, of `<think>` and `</think>` (the embedded tokenizer's)
# a reasoning model's outputs: reasoning that ends, marked at its start too, never ends, ends at once
THOUGHTS = [
    "Two and two.</think>The answer is 4.",
    "<think>Hmm, two and two.</think>\n\nFour.",
    "Still thinking when max_tokens cut it",
    "</think>Straight to it.",
]
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
    model = str(tokenizer_dir)
    catalogue = [ServedModel(name=p, model=model, tool_call_parser=p) for p in PARSERS]
    catalogue += [ServedModel(name=f"think-{p}", model=model, reasoning_parser=p) for p in REASONING]
    catalogue += [
        ServedModel(name="think-hermes", model=model, reasoning_parser="deepseek_r1", tool_call_parser="hermes")
    ]
    return OutputParsers([*catalogue, ServedModel(name="plain", model=model)], tokenizer_dir)


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
        whole = ResponseShape(True, "id", name, reading=parsers.reading(body)).final(
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
            shape, parser = ResponseShape(True, "id", name, reading=parsers.reading(body)), their_parser()
            ours: dict[int, list[str]] = {}
            their_calls: dict[int, list[str]] = {}
            shown, their_shown, done = "", "", 0
            for i, piece in enumerate(pieces):
                delta_text = tokenizer.decode(ids[: done + len(piece)])[len(tokenizer.decode(ids[:done])) :]
                done += len(piece)
                last = i == len(pieces) - 1
                delta = TokenDelta(text=delta_text, token_ids=piece, finish_reason="stop" if last else None)
                event = shape.chunk_event(delta, first=i == 0)
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
    update = parsers.reading(ChatCompletionRequest(**CHAT | {"model": name}, **fields)).sampling_update
    assert update.keys() == {"skip_special_tokens", "structured"}
    assert update["skip_special_tokens"] == their.skip_special_tokens
    structured = update["structured"] and StructuredOutputsParams(**update["structured"])  # (as the workers make it)
    assert structured == their.structured_outputs


def test_a_parser_adjusts_the_requests_sampling_as_vllms_server_does(parsers):
    """Hermes keeps special tokens (its tags may be ones); pythonic changes nothing."""
    body = ChatCompletionRequest(**CHAT | {"model": "hermes"}, tools=[WEATHER])
    assert parsers.reading(body).sampling_update == {"skip_special_tokens": False, "structured": None}
    body = ChatCompletionRequest(**CHAT | {"model": "pythonic"}, tools=[WEATHER], structured_outputs={"regex": "x"})
    assert parsers.reading(body).sampling_update == {"skip_special_tokens": True, "structured": body.structured()}
    assert body.structured()["regex"] == "x"  # (the request's own constraint kept)


def test_auto_without_a_parser_is_vllms_400_naming_the_setting_and_a_bad_parser_stops_the_start(parsers, tokenizer_dir):
    for choice in (None, "auto"):
        body = ChatCompletionRequest(**CHAT | {"model": "plain"}, tools=[WEATHER], tool_choice=choice)
        with pytest.raises(InvalidRequest, match="tool_call_parser") as refused:
            parsers.reading(body)
        assert refused.value.param == "tool_choice"
    assert not ChatCompletionRequest(**CHAT | {"model": "plain"}, tools=[WEATHER], tool_choice="none").auto_tools
    with pytest.raises(ValueError, match="'odd': tool_call_parser 'nope'"):
        OutputParsers([ServedModel(name="odd", model=str(tokenizer_dir), tool_call_parser="nope")], tokenizer_dir)


def their_reader(tokenizer_dir, reasoning: str, tool_parser: str | None = None, **fields):
    """vLLM's server's request and a parser for it, with a reasoning parser (and a tool-call parser)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(tokenizer_dir))
    parser_class = ParserManager.get_parser(
        tool_parser_name=tool_parser,
        reasoning_parser_name=reasoning,
        enable_auto_tools=bool(tool_parser),
        tokenizer=tokenizer,
    )
    request = VllmRequest(**CHAT | {"model": "m"}, **fields)
    kwargs = ChatCompletionRequest(**CHAT, **fields).template_kwargs()
    request = parser_class(tokenizer, request.tools, chat_template_kwargs=kwargs).adjust_request(request)
    return request, lambda: parser_class(tokenizer, request.tools, chat_template_kwargs=kwargs), tokenizer


def prompt_ids(tokenizer, **template_kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(
        CHAT["messages"], add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def streamed(
    shape: ResponseShape,
    tokenizer,
    ids: list[int],
    prompt: list[int],
    rng: random.Random,
    their=None,
    request=None,
    reasoning_so_far: list | None = None,
) -> tuple[list[dict], list]:
    """The chunks' choices of a stream of `ids` cut at random whole characters (the first with the prompt's
    ids), and vLLM's parser's deltas (`their`, of `request`) for the same cuts; with continuous usage, the
    last chunk's reasoning tokens go to `reasoning_so_far`."""
    text = tokenizer.decode(ids)
    boundaries = [k for k in range(1, len(ids)) if text.startswith(tokenizer.decode(ids[:k]))]
    cuts = sorted(rng.sample(boundaries, k=min(len(boundaries), rng.randint(1, 8))))
    chunks, their_deltas, done = [], [], 0
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(ids)])):
        delta_text = tokenizer.decode(ids[:b])[len(tokenizer.decode(ids[:done])) :]
        done = b
        last = b == len(ids)
        delta = TokenDelta(
            text=delta_text,
            token_ids=ids[a:b],
            finish_reason="stop" if last else None,
            prompt_token_ids=prompt,
            prompt_tokens=len(prompt),  # (shown with continuous usage)
            completion_tokens=b,
        )
        event = shape.chunk_event(delta, first=i == 0)
        if event:
            chunks.append(json.loads(event[6:]))
        if their is not None:
            their_deltas.append(their.parse_delta(delta_text, ids[a:b], request, prompt, finished=last))
    if chunks and "usage" in chunks[-1]:
        assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
        reasoning_so_far.append(chunks[-1]["usage"].get("completion_tokens_details"))
    return [c["choices"][0] for c in chunks], [d for d in their_deltas if d]


def joined(chunks: list[dict], field: str) -> str | None:
    parts = [c["delta"][field] for c in chunks if c["delta"].get(field) is not None]
    return "".join(parts) if parts else None


@pytest.mark.parametrize("name", REASONING)
@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_whole_and_streamed_is_what_vllms_server_reads_cut_anywhere(parsers, tokenizer_dir, name, thinking):
    """The template may end the reasoning in the prompt (enable_thinking false: `<think></think>` there), which
    a stream's parser reads from the prompt's ids; usage counts the reasoning tokens as vLLM's server does."""
    fields = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
    their_request, their_parser, tokenizer = their_reader(tokenizer_dir, name, **fields)
    prompt = prompt_ids(tokenizer, **fields.get("chat_template_kwargs", {}))
    body = ChatCompletionRequest(**CHAT | {"model": f"think-{name}"}, **fields)
    rng = random.Random(5)
    for text in THOUGHTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        parser = their_parser()
        parser.set_prompt_token_ids(prompt)
        reasoning, content, _ = parser.parse(text, their_request, model_output_token_ids=ids)
        count = parser.count_reasoning_tokens(ids)
        whole = ResponseShape(True, "id", "m", reading=parsers.reading(body)).final(
            [Choice(text, "stop", len(ids), ids, prompt_token_ids=prompt)], 3
        )
        message = whole["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (reasoning, content), text
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": count}
        for cut in range(4):
            shape = ResponseShape(True, "id", "m", reading=parsers.reading(body), continuous_usage=cut % 2 == 1)
            so_far: list = []
            chunks, their_deltas = streamed(shape, tokenizer, ids, prompt, rng, their_parser(), their_request, so_far)
            assert so_far == ([{"reasoning_tokens": count}] if cut % 2 else [])
            theirs_shown = [{"delta": d.model_dump(exclude_unset=True)} for d in their_deltas]
            assert (joined(chunks, "reasoning"), joined(chunks, "content") or "") == (
                joined(theirs_shown, "reasoning"),
                joined(theirs_shown, "content") or "",
            ), text
            assert shape.usage_chunk(3, len(ids))["usage"]["completion_tokens_details"] == {"reasoning_tokens": count}
            assert chunks[-1]["finish_reason"] == "stop"


def test_without_reasoning_included_the_reasoning_and_the_tokens_that_would_show_it_are_left_out(
    parsers, tokenizer_dir
):
    """vLLM's include_reasoning false: no reasoning, and no logprobs or token ids (whole or streamed)."""
    body = ChatCompletionRequest(**CHAT | {"model": "think-deepseek_r1"}, include_reasoning=False)
    _, _, tokenizer = their_reader(tokenizer_dir, "deepseek_r1")
    text = THOUGHTS[0]
    ids, prompt = tokenizer.encode(text, add_special_tokens=False), prompt_ids(tokenizer)
    steps = [[(t, -0.5, tokenizer.decode([t]))] for t in ids]
    shape = ResponseShape(True, "id", "m", logprobs=1, reading=parsers.reading(body), with_token_ids=True)
    choice = shape.final([Choice(text, "stop", len(ids), ids, steps, prompt_token_ids=prompt)], 3)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "The answer is 4.", "reasoning": None}
    assert choice["logprobs"] is None and "token_ids" not in choice
    shape = ResponseShape(True, "id", "m", logprobs=1, reading=parsers.reading(body), with_token_ids=True)
    chunks, _ = streamed(shape, tokenizer, ids, prompt, random.Random(1))
    assert joined(chunks, "content") == "The answer is 4." and joined(chunks, "reasoning") is None
    assert all(c["logprobs"] is None and "token_ids" not in c for c in chunks)


def test_calls_past_the_reasoning_are_read_by_the_tool_parser_or_forced_as_json_without_one(parsers, tokenizer_dir):
    """With both parsers, "auto" reads the calls past the reasoning as vLLM's server does; with a reasoning
    parser alone, a forced call is JSON read from the content (vLLM's server reads none there)."""
    fields = {"tools": [WEATHER, TIME]}
    their_request, their_parser, tokenizer = their_reader(tokenizer_dir, "deepseek_r1", "hermes", **fields)
    text = 'Weather first.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ids, prompt = tokenizer.encode(text, add_special_tokens=False), prompt_ids(tokenizer)
    reasoning, content, calls = their_parser().parse(text, their_request, True, ids)
    body = ChatCompletionRequest(**CHAT | {"model": "think-hermes"}, **fields)
    whole = ResponseShape(True, "id", "m", reading=parsers.reading(body)).final(
        [Choice(text, "stop", len(ids), ids, prompt_token_ids=prompt)], 3
    )
    answer = whole["choices"][0]
    assert (
        (answer["message"]["reasoning"], answer["message"]["content"])
        == (reasoning, content)
        == ("Weather first.", None)
    )
    assert plain_calls(answer["message"]["tool_calls"]) == [(c.name, c.arguments) for c in calls]
    assert answer["finish_reason"] == "tool_calls"

    forced = fields | {"tool_choice": "required"}
    body = ChatCompletionRequest(**CHAT | {"model": "think-deepseek_r1"}, **forced)
    reading = parsers.reading(body)
    assert reading.sampling_update["structured"] == body.tool_calling.constraint()  # (the JSON array)
    text = 'Time it is.</think>[{"name": "get_time", "parameters": {}}]'
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = ResponseShape(True, "id", "m", reading=reading).final(
        [Choice(text, "stop", len(ids), ids, prompt_token_ids=prompt)], 3
    )
    answer = whole["choices"][0]
    assert answer["message"]["reasoning"] == "Time it is." and answer["finish_reason"] == "tool_calls"
    assert plain_calls(answer["message"]["tool_calls"]) == [("get_time", "{}")]
    shape = ResponseShape(True, "id", "m", reading=parsers.reading(body))
    chunks, _ = streamed(shape, tokenizer, ids, prompt, random.Random(2))
    streamed_calls: dict[int, list[str]] = {}
    for chunk in chunks:
        accumulate(streamed_calls, chunk["delta"].get("tool_calls"))
    assert joined(chunks, "reasoning") == "Time it is." and list(streamed_calls.values()) == [["get_time", "{}"]]
    assert chunks[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_a_structured_output_waits_for_the_reasoning_where_vllms_server_has_its_engine_wait(
    parsers, tokenizer_dir, include_reasoning
):
    """The engines get vLLM's `reasoning_ended` where the request decides it (True: constrained from the first
    token) and the template's variables their parser reads; without a constraint, nothing."""
    from llmesh.wire.messages import ReasoningGate

    fields = {"response_format": {"type": "json_object"}, "include_reasoning": include_reasoning}
    fields |= {"chat_template_kwargs": {"enable_thinking": True}}
    their_request, their_parser, tokenizer = their_reader(tokenizer_dir, "deepseek_r1", **fields)
    body = ChatCompletionRequest(**CHAT | {"model": "think-deepseek_r1"}, **fields)
    update = parsers.reading(body).sampling_update
    assert update["structured"] == body.structured()
    ended = their_request.resolve_reasoning_ended(their_parser(), prompt_ids(tokenizer))  # (vLLM's server's)
    assert update["reasoning"] == ReasoningGate(from_start=ended, chat_template_kwargs=body.template_kwargs())
    assert ended is (not include_reasoning)
    plain = ChatCompletionRequest(**CHAT | {"model": "think-deepseek_r1"})
    assert "reasoning" not in parsers.reading(plain).sampling_update


def test_a_parser_the_tokenizer_cannot_serve_stops_the_start_naming_the_model(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"  # a tokenizer without the reasoning markers
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(bare)
    (bare / "tokenizer.json").write_text(
        (bare / "tokenizer.json").read_text().replace('"<think>"', '"<x1>"').replace('"</think>"', '"<x2>"')
    )
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'r1': reasoning_parser 'deepseek_r1'"):
        OutputParsers([ServedModel(name="r1", model=str(bare), reasoning_parser="deepseek_r1")], tmp_path)
    with pytest.raises(ValueError, match="'odd': reasoning_parser 'nope'"):
        OutputParsers([ServedModel(name="odd", model=str(tokenizer_dir), reasoning_parser="nope")], tokenizer_dir)


@pytest.mark.parametrize("name", ["mistral", "pythonic"])
def test_tool_choice_none_is_read_by_the_models_parser_as_vllms_server_reads_it(parsers, tokenizer_dir, name):
    """A model with a tool-call parser reads every chat, "none" too, as vLLM's server reads it (an engine-based
    parser, mistral's, may drop call markup there; a legacy one, pythonic, leaves the text): no call."""
    fields = {"tools": [WEATHER], "tool_choice": "none"}
    their_request, their_parser, tokenizer = theirs(tokenizer_dir, name, **fields)
    body = ChatCompletionRequest(**CHAT | {"model": name}, **fields)
    for text in ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Plain text."):
        ids = tokenizer.encode(text, add_special_tokens=False)
        _, content, calls = their_parser().parse(
            text, their_request, enable_auto_tools=True, model_output_token_ids=ids
        )
        answer = ResponseShape(True, "id", name, reading=parsers.reading(body)).final([Choice(text, "stop", 1, ids)], 3)
        message = answer["choices"][0]["message"]
        assert (message["content"], message.get("tool_calls"), answer["choices"][0]["finish_reason"]) == (
            content,
            None,
            "stop",
        )
        assert not calls
