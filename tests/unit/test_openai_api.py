import itertools
import json

import pytest

from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import TokenDelta
from llmesh_router.shapes import Choice, ResponseShape, sse

TEXTS = ["", "plain", 'quote " and \\ backslash', "line\nbreak\ttab", "ünïcødé ✓ 🚀", "\x00 nul", '"\\u0000"']


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", ["m", 'odd "model"\x00 \\u0000'])
def test_chunk_event_renders_exactly_the_chunk(chat, model):
    shape = ResponseShape(chat, "req-1", model)
    for first, finish_reason, index in itertools.product((True, False), (None, "stop", "length"), (0, 3)):
        stop_reasons = (None, "END", 7) if finish_reason == "stop" else (None,)
        for text, stop_reason in itertools.product(
            TEXTS, stop_reasons
        ):  # a template each (finish_reason, first, index)
            delta = TokenDelta(text=text, token_ids=[], finish_reason=finish_reason, stop_reason=stop_reason)
            event = shape.chunk_event(delta, index, first)
            assert event == sse(shape.chunk(delta, index, first))
            choice = json.loads(event.removeprefix(b"data: "))["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"], choice["index"]) == (
                finish_reason,
                stop_reason,
                index,
            )


@pytest.mark.parametrize(
    "field, value, fits",
    [
        ("seed", 2**63, 2**62),
        ("priority", -(2**63) - 1, -(2**62)),
        ("max_tokens", 2**63, 2**62),
        ("prompt", [1, 2**64], [1, 2**62]),
        ("top_k", 2**63, 2**62),
        ("min_tokens", 2**63, 16),
        ("stop_token_ids", [2**63], [2**62]),
    ],
)
def test_integers_beyond_what_the_bus_carries_are_refused_at_the_door(field, value, fits):
    """(Found by schemathesis: a 2**64 seed reached MessagePack and answered 500.)"""
    from pydantic import ValidationError

    from llmesh.wire.messages import encode
    from llmesh_router.schemas import CompletionRequest

    with pytest.raises(ValidationError):
        CompletionRequest(**{"model": "m", "prompt": "hi", field: value})
    encode(CompletionRequest(**{"model": "m", "prompt": "hi", field: fits}).sampling())


def test_a_message_with_an_integer_beyond_64_bits_is_a_bad_message():
    from llmesh.wire.errors import BadMessage
    from llmesh.wire.messages import SamplingOptions, encode

    with pytest.raises(BadMessage, match="beyond 64 bits"):
        encode(SamplingOptions(max_tokens=1, seed=2**70))


def test_vllms_sampling_fields_reach_the_engines_options_checked_and_clamped():
    from pydantic import ValidationError

    from llmesh_router.schemas import ChatCompletionRequest, CompletionRequest

    fields = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "min_tokens": 3, "logit_bias": {"7": 250, "9": -2}}
    options = CompletionRequest(model="m", prompt="hi", stop_token_ids=[4, 2], **fields).sampling()
    assert (options.top_k, options.min_p, options.repetition_penalty, options.min_tokens) == (5, 0.1, 1.3, 3)
    assert options.stop_token_ids == [4, 2]
    assert options.logit_bias == {"7": 100.0, "9": -2.0}  # OpenAI's range
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4)
    assert chat.sampling().max_tokens == 4
    for bad in (
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"-1": 1}},
        {"logit_bias": {"1": float("nan")}},
        {"logit_bias": {str(i): 1 for i in range(301)}},
        {"repetition_penalty": 0},
        {"top_k": -2},
        {"min_p": 1.5},
        {"min_tokens": -1},
        {"stop_token_ids": [-1]},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="hi", **bad)


def test_structured_outputs_and_response_format_reach_the_engines_options_as_vllms_server_combines_them():
    from pydantic import ValidationError

    from llmesh.engine.worker import sampling_params
    from llmesh_router.schemas import ChatCompletionRequest, CompletionRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
            {"json": schema},
        ),
        ({"structured_outputs": {"regex": "[ab]+", "disable_any_whitespace": True}}, {"regex": "[ab]+"}),
        ({"structured_outputs": {"choice": ["x", "y"]}}, {"choice": ["x", "y"]}),
        ({"structured_outputs": {"json": schema}}, {"json": schema}),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"grammar": 'root ::= "a"'}),
    ]
    for fields, constraint in cases:
        for request in (CompletionRequest(model="m", prompt="hi", **fields), ChatCompletionRequest(**chat, **fields)):
            options = request.sampling()
            if constraint is None:
                assert options.structured is None
                continue
            assert options.structured is not None and constraint.items() <= options.structured.items()
            params = sampling_params(options, max_tokens=4, kv_transfer_params={}, generated=2)
            assert params.structured_outputs is not None and params.extra_args["earlier_output"] == 2
    assert CompletionRequest(
        model="m", prompt="hi", structured_outputs={"regex": "a", "disable_any_whitespace": True}
    ).sampling().structured == {"regex": "a", "disable_any_whitespace": True, "disable_additional_properties": False}
    for bad in (
        {"structured_outputs": {}},  # no constraint
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},  # two
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": {"structural_tag": "{}"}},  # not done
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema"}},  # no schema (vLLM's error)
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
        {"response_format": {"type": "structural_tag", "format": {}}},
    ):
        with pytest.raises((ValidationError, InvalidRequest)):
            CompletionRequest(model="m", prompt="hi", **bad)


def test_sampling_params_owe_a_resumed_engine_only_the_rest_of_min_tokens():
    from llmesh.engine.worker import sampling_params
    from llmesh.wire.messages import SamplingOptions

    options = SamplingOptions(
        max_tokens=10,
        min_tokens=4,
        logit_bias={"7": 5.0},
        repetition_penalty=1.2,
        top_k=3,
        min_p=0.2,
        stop_token_ids=[6],
    )
    prefill = sampling_params(options, max_tokens=1, kv_transfer_params={})  # the first token only
    decode = sampling_params(options, max_tokens=9, kv_transfer_params={}, generated=1)
    late = sampling_params(options, max_tokens=3, kv_transfer_params={}, generated=7)
    assert (prefill.min_tokens, decode.min_tokens, late.min_tokens) == (1, 3, 0)
    assert (decode.logit_bias, decode.repetition_penalty, decode.top_k, decode.min_p) == ({7: 5.0}, 1.2, 3, 0.2)
    assert decode.stop_token_ids == [6]
    assert sampling_params(SamplingOptions(), max_tokens=2, kv_transfer_params={}).logit_bias is None


STEPS = [  # TokenDelta.logprobs of three tokens: the sampled one first, then the likeliest
    [(5, -0.5, " the"), (7, -1.25, "a")],
    [(9, -2.0, "\u00e9"), (9, -2.0, "\u00e9"), (3, float("-inf"), "")][1:],  # sampled and likeliest: once
    [(4, float("-inf"), "x"), (2, -0.1, " y"), (8, -3.0, "\ufffd")],
]


def _vllm_steps(steps):
    from vllm.logprobs import Logprob

    return [t[0][0] for t in steps], [{i: Logprob(lp, None, text) for i, lp, text in step} for step in steps]


@pytest.mark.parametrize("top", [0, 1, 2, 5])
def test_logprobs_render_as_vllms_server_renders_them(top):
    """Against vLLM's own OpenAI server functions, fed the same engine output (streamed in pieces too)."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    token_ids, steps = _vllm_steps(STEPS)
    chat_server = SimpleNamespace(return_tokens_as_token_ids=False)
    chat_server._get_decoded_token = OpenAIServingChat._get_decoded_token
    chat_server._get_top_logprobs = lambda *a, **k: OpenAIServingChat._get_top_logprobs(chat_server, *a, **k)
    chat = OpenAIServingChat._create_chat_logprobs(chat_server, token_ids, steps, None, top).model_dump()
    completion_server = SimpleNamespace(return_tokens_as_token_ids=False)
    completion_server._get_decoded_token = OpenAIServingCompletion._get_decoded_token
    completion = OpenAIServingCompletion._create_completion_logprobs(
        completion_server, token_ids, steps, top, None
    ).model_dump()

    choice = Choice("", "stop", 3, logprobs=STEPS)
    assert ResponseShape(True, "r", "m", top).final([choice], 1)["choices"][0]["logprobs"] == chat
    assert ResponseShape(False, "r", "m", top).final([choice, choice], 1)["choices"][1]["logprobs"] == completion
    streamed = ResponseShape(False, "r", "m", top)
    pieces = [  # two choices' streams interleaved: each its own text offsets
        streamed.chunk(TokenDelta(text="", token_ids=[], logprobs=part), index)["choices"][0]["logprobs"]
        for part in (STEPS[:1], STEPS[1:])
        for index in (0, 1)
    ]
    for index in (0, 1):
        assert [offset for piece in pieces[index::2] for offset in piece["text_offset"]] == completion["text_offset"]
    unasked = ResponseShape(True, "r", "m").chunk(TokenDelta(text="x", token_ids=[], logprobs=STEPS))
    assert unasked["choices"][0]["logprobs"] is None


def test_logprob_token_ids_show_every_requested_token_as_vllms_server_shows_them():
    """With logprob_token_ids each step holds the sampled token and the requested ones, all shown (vLLM's servers'
    `return_all`), whatever `logprobs` or `top_logprobs` says; without `logprobs` it is vLLM's 400."""
    from types import SimpleNamespace

    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from llmesh_router.schemas import ChatCompletionRequest, CompletionRequest

    labels = [7, 2, 8]
    token_ids, steps = _vllm_steps(STEPS)
    chat_server = SimpleNamespace(return_tokens_as_token_ids=False)
    chat_server._get_decoded_token = OpenAIServingChat._get_decoded_token
    chat_server._get_top_logprobs = lambda *a, **k: OpenAIServingChat._get_top_logprobs(chat_server, *a, **k)
    chat = OpenAIServingChat._create_chat_logprobs(chat_server, token_ids, steps, None, 0, labels).model_dump()
    completion_server = SimpleNamespace(return_tokens_as_token_ids=False)
    completion_server._get_decoded_token = OpenAIServingCompletion._get_decoded_token
    completion = OpenAIServingCompletion._create_completion_logprobs(
        completion_server, token_ids, steps, 0, None, labels
    ).model_dump()

    messages = [{"role": "user", "content": "hi"}]
    chat_request = ChatCompletionRequest(model="m", messages=messages, logprobs=True, logprob_token_ids=labels)
    completion_request = CompletionRequest(model="m", prompt="x", logprobs=0, logprob_token_ids=labels)
    assert chat_request.sampling().logprob_token_ids == completion_request.sampling().logprob_token_ids == labels
    choice = Choice("", "stop", 3, logprobs=STEPS)
    shown = ResponseShape(True, "r", "m", chat_request.shown_logprobs).final([choice], 1)
    assert shown["choices"][0]["logprobs"] == chat
    shown = ResponseShape(False, "r", "m", completion_request.shown_logprobs).final([choice], 1)
    assert shown["choices"][0]["logprobs"] == completion
    with pytest.raises(InvalidRequest, match="`logprobs` must be set"):
        CompletionRequest(model="m", prompt="x", logprob_token_ids=labels)
    with pytest.raises(ValidationError, match="at most 128"):
        CompletionRequest(model="m", prompt="x", logprobs=1, logprob_token_ids=list(range(129)))


@pytest.mark.parametrize("top", [0, 2])
def test_an_echoed_prompts_logprobs_render_as_vllms_server_renders_them(top):
    """The prompt's first token has no logprob (vLLM: None, its text decoded); a delta echoed puts the
    prompt's text and steps before its own."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from llmesh.wire.messages import TokenDelta
    from llmesh_router.shapes import echoed

    prompt_steps = [[(1, None, "<s>")], *STEPS[:2]]
    delta = TokenDelta(
        text=" out", token_ids=[4], prompt_text="the prompt", prompt_logprobs=prompt_steps, logprobs=STEPS[2:]
    )
    first = echoed(delta)
    assert first.text == "the prompt out" and first.logprobs == [*prompt_steps, *STEPS[2:]]
    token_ids, steps = _vllm_steps(first.logprobs[1:])
    server = SimpleNamespace(return_tokens_as_token_ids=False)
    server._get_decoded_token = OpenAIServingCompletion._get_decoded_token
    expected = OpenAIServingCompletion._create_completion_logprobs(
        server, [1, *token_ids], [None, *steps], top, SimpleNamespace(decode=lambda token: "<s>")
    ).model_dump()
    assert ResponseShape(False, "r", "m", top).final([Choice.of([first])], 3)["choices"][0]["logprobs"] == expected
    assert echoed(delta.model_copy(update={"logprobs": None})).logprobs is None  # no logprobs asked: text alone
    alone = echoed(delta, prompt_alone=True)  # max_tokens 0
    assert (alone.text, alone.logprobs) == ("the prompt", prompt_steps)
    # with return_token_ids, vLLM's server echoes no prompt text (the prompt's ids stand for it), its logprobs yes
    ids_shown = echoed(delta, with_text=False)
    assert (ids_shown.text, ids_shown.logprobs) == (" out", first.logprobs)


@pytest.mark.parametrize("chat", [False, True])
def test_return_token_ids_shows_the_prompts_ids_as_vllms_server_does(chat):
    """A completion's in each choice (its first chunk's, streamed), a chat's once in the answer (and in each
    choice's first chunk), as vLLM 0.32's server returns them; not asked, not shown."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse, ChatCompletionStreamResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionStreamResponse

    choices = [Choice("ab", "stop", 2, [7, 8], prompt_token_ids=[1, 2, 3]) for _ in range(2)]
    whole = ResponseShape(chat, "r", "m", with_token_ids=True).final(choices, 3)
    (ChatCompletionResponse if chat else CompletionResponse).model_validate(whole)  # (vLLM's schema)
    if chat:
        assert whole["prompt_token_ids"] == [1, 2, 3] and "prompt_token_ids" not in whole["choices"][0]
    else:
        assert [c["prompt_token_ids"] for c in whole["choices"]] == [[1, 2, 3]] * 2 and "prompt_token_ids" not in whole
    shape = ResponseShape(chat, "r", "m", with_token_ids=True)
    opening = TokenDelta(text="a", token_ids=[7], prompt_token_ids=[1, 2, 3])
    first = json.loads(shape.chunk_event(opening, first=True)[6:])
    later = json.loads(shape.chunk_event(TokenDelta(text="b", token_ids=[8], finish_reason="stop"))[6:])
    (ChatCompletionStreamResponse if chat else CompletionStreamResponse).model_validate(first)
    shown = first if chat else first["choices"][0]
    assert shown["prompt_token_ids"] == [1, 2, 3]
    assert "prompt_token_ids" not in later and "prompt_token_ids" not in later["choices"][0]
    plain = ResponseShape(chat, "r", "m").final(choices, 3)
    assert "prompt_token_ids" not in plain and "prompt_token_ids" not in plain["choices"][0]
    opening = TokenDelta(text="a", token_ids=[7], prompt_token_ids=[1])
    unasked = json.loads(ResponseShape(chat, "r", "m").chunk_event(opening, first=True)[6:])
    assert "prompt_token_ids" not in unasked and "prompt_token_ids" not in unasked["choices"][0]


def test_max_tokens_0_is_an_echo_of_the_prompt_alone_and_refused_without_echo():
    from llmesh.wire.errors import InvalidRequest
    from llmesh_router.schemas import CompletionRequest

    assert CompletionRequest(model="m", prompt="hi", max_tokens=0, echo=True).sampling().max_tokens == 1
    with pytest.raises(InvalidRequest, match="0 only with echo"):
        CompletionRequest(model="m", prompt="hi", max_tokens=0)


def test_logprobs_asked_reach_the_engines_options():
    from pydantic import ValidationError

    from llmesh_router.schemas import ChatCompletionRequest, CompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    assert CompletionRequest(model="m", prompt="hi", logprobs=3).sampling().logprobs == 3
    assert CompletionRequest(model="m", prompt="hi").sampling().logprobs is None
    assert ChatCompletionRequest(model="m", messages=messages, logprobs=True).sampling().logprobs == 0
    assert ChatCompletionRequest(model="m", messages=messages, logprobs=True, top_logprobs=4).sampling().logprobs == 4
    assert ChatCompletionRequest(model="m", messages=messages, top_logprobs=4).sampling().logprobs is None
    for bad in ({"logprobs": 21}, {"logprobs": -1}):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", prompt="hi", **bad)
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=messages, logprobs=True, top_logprobs=21)


def test_chat_text_parts_join_as_vllm_joins_them_and_other_parts_are_named_in_the_error():
    from pydantic import ValidationError

    from llmesh_router.schemas import ChatCompletionRequest

    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": parts}])
    assert chat.messages[0].to_message().content == "first\nsecond"  # vLLM's renderers/chat_utils.py
    with pytest.raises(ValidationError, match="only text content parts are supported, not 'image_url'"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])


# ---- the router's /metrics, in-process (FastAPI over httpx's ASGI transport, a stand-in dispatcher) ----------


class _Dispatcher:
    """Streams `outputs` (token ids per delta; a token's text: x, or <seed> for a seeded request) for
    each request of a served model, once `go` is set; meanwhile a request of `queued_model` counts as
    waiting in the router's queue."""

    def __init__(self, metrics, registry, outputs: list[list[int]], queued_model: str = ""):
        import asyncio

        self.metrics, self.registry, self.outputs, self.queued_model = metrics, registry, outputs, queued_model
        self.go = asyncio.Event()
        self.go.set()
        self.requests: list = []  # the Generations asked for
        self.ends: list[str] = []  # how each stream that yielded ended: "finished", or "closed" before its end
        self.refused_suffix = ""  # requests whose id ends so are refused as at capacity
        self.lost_after: int | None = None  # deltas after which each stream fails (its worker lost)
        self.pause_s = 0.0  # between deltas (0: the next turn of the loop)
        self.together = False  # every delta at once (as one bus message would bring them)
        self.tokenizer_queries: list = []

    async def ask_tokenizer(self, query, expected):
        from llmesh.wire.messages import Detokenized, Tokenized

        self.registry.check_known(query.model)
        self.tokenizer_queries.append(query)
        if expected is Detokenized:
            return Detokenized(text=" ".join(map(str, query.tokens)))
        return Tokenized(tokens=[7, 8, 9], token_strs=["a", "b", "c"] if query.token_strs else None, max_model_len=64)

    async def generate(self, gen, parent, sink):
        import asyncio

        from llmesh.wire.errors import AtCapacity, ModelNotFound, WorkerLost
        from llmesh.wire.messages import TokenDelta

        self.requests.append(gen)
        if gen.model == self.queued_model:
            with self.metrics.queued(gen.model):
                await self.go.wait()
        await self.go.wait()
        if gen.model not in self.registry.models():
            raise ModelNotFound(f"no {gen.model}")
        if gen.request_id.endswith(self.refused_suffix or "\0"):
            raise AtCapacity("every worker is full")
        done, finished = 0, False
        try:
            for i, ids in enumerate(self.outputs):
                if not self.together:
                    await asyncio.sleep(self.pause_s)  # other requests' deltas between this one's
                if i == self.lost_after:
                    raise WorkerLost("the decode worker is gone")
                done += len(ids)
                sink(
                    TokenDelta(
                        text=("x" if gen.sampling.seed is None else f"<{gen.sampling.seed}>") * len(ids),
                        token_ids=ids,
                        prompt_tokens=5,
                        completion_tokens=done,
                        finish_reason="length" if i == len(self.outputs) - 1 else None,
                        prompt_text="<rendered>" if gen.sampling.prompt_text and i == 0 else None,
                    )
                )
            finished = True
        finally:
            if not finished:
                await asyncio.sleep(0)  # as the dispatcher's abort to the worker does: an await in the cleanup
            self.ends.append("finished" if finished else "closed")


def _router(outputs, queued_model="", **options):
    import httpx

    from llmesh.wire.messages import WorkerInfo
    from llmesh_router.metrics import RouterMetrics
    from llmesh_router.registry import WorkerRegistry
    from llmesh_router.service import create_app

    registry = WorkerRegistry()
    for model in ("m", "n"):
        registry.on_heartbeat(
            WorkerInfo(
                worker_id=model,
                role="prefill",
                model=model,
                fingerprint="f",
                max_model_len=64,
                running=0,
                queued_tokens=0,
                capacity=4,
                heartbeat_s=1.0,
            )
        )
    metrics = RouterMetrics()
    dispatcher = _Dispatcher(metrics, registry, outputs, queued_model)
    app = create_app(dispatcher, registry, metrics, request_timeout_s=5, **options)
    return dispatcher, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def _samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()))}}}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_after_requests_carry_vllms_names_labels_and_buckets():
    from llmesh_router.metrics import INTER_TOKEN_LATENCY_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS

    outputs = [[1], [2, 3], [4]]  # the first token, then 3 more in 2 deltas
    _, client = _router(outputs)
    async with client:
        for stream in (False, True):
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": stream})
            assert resp.status_code == 200, resp.text
        text = (await client.get("/metrics")).text
    got, model = _samples(text), "model_name=m"
    assert got[f"vllm:time_to_first_token_seconds_count{{{model}}}"] == 2
    assert got[f"vllm:inter_token_latency_seconds_count{{{model}}}"] == 2 * 3  # one per token after the first
    assert got[f"vllm:request_time_per_output_token_seconds_count{{{model}}}"] == 2
    assert got[f"vllm:e2e_request_latency_seconds_count{{{model}}}"] == 2
    assert got[f"vllm:prompt_tokens_total{{{model}}}"] == 2 * 5
    assert got[f"vllm:generation_tokens_total{{{model}}}"] == 2 * 4
    assert got[f"vllm:request_success_total{{finished_reason=length,{model}}}"] == 2
    assert got[f"vllm:num_requests_running{{{model}}}"] == got[f"vllm:num_requests_waiting{{{model}}}"] == 0
    for metric, buckets in [
        ("vllm:time_to_first_token_seconds", TIME_TO_FIRST_TOKEN_BUCKETS),
        ("vllm:inter_token_latency_seconds", INTER_TOKEN_LATENCY_BUCKETS),
    ]:
        bounds = sorted(
            float(k.split("le=")[1].split(",")[0].rstrip("}")) for k in got if k.startswith(f"{metric}_bucket{{")
        )
        assert bounds == [*buckets, float("inf")], metric
    for old in (
        "llmesh_time_to_first_token_seconds",
        "llmesh_generated_tokens",
        "llmesh_request_seconds",
        "llmesh_requests_inflight",
        "llmesh_queue_wait_seconds",
    ):
        assert old not in text  # replaced by vLLM's names, not exported twice


async def test_running_and_waiting_requests_per_served_model():
    """A request in flight runs; one in the router's queue waits; a model nobody serves is no series."""
    import asyncio

    dispatcher, client = _router([[1]], queued_model="m")
    dispatcher.go.clear()
    async with client:
        calls = [
            asyncio.create_task(client.post("/v1/completions", json={"model": model, "prompt": "hi"}))
            for model in ("m", "m", "n", "made-up")
        ]
        await asyncio.sleep(0.1)
        during = _samples((await client.get("/metrics")).text)
        dispatcher.go.set()
        statuses = [r.status_code for r in await asyncio.gather(*calls)]
        after = _samples((await client.get("/metrics")).text)
    assert statuses == [200, 200, 200, 404]
    waiting, running = "vllm:num_requests_waiting{model_name=%s}", "vllm:num_requests_running{model_name=%s}"
    assert (during[waiting % "m"], during[running % "m"], during[waiting % "n"], during[running % "n"]) == (2, 0, 0, 1)
    assert not any("made-up" in key for key in [*during, *after])
    assert [after[name % model] for name in (waiting, running) for model in "mn"] == [0, 0, 0, 0]
    assert after["vllm:request_success_total{finished_reason=length,model_name=n}"] == 1


def _events(body: str) -> list:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("chat", [False, True])
async def test_n_choices_are_requests_of_their_own_choice_i_seeded_with_seed_plus_i(chat):
    """As vLLM's parallel sampling: choice i is the request for one choice with seed + i; usage counts the
    prompt once and every choice's tokens; streamed, the choices' chunks interleave, each with its index."""
    dispatcher, client = _router([[1], [2, 3]])
    path, prompt = ("/v1/chat/completions", "messages") if chat else ("/v1/completions", "prompt")
    body = {"model": "m", prompt: [{"role": "user", "content": "hi"}] if chat else "hi", "n": 3, "seed": 7}
    continuous = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with client:
        whole = (await client.post(path, json=body)).json()
        streamed = await client.post(path, json=body | {"stream": True, "stream_options": {"include_usage": True}})
        counted = await client.post(path, json=body | continuous)
    texts = ["<7>" * 3, "<8>" * 3, "<9>" * 3]
    assert [(c["index"], c["message"]["content"] if chat else c["text"]) for c in whole["choices"]] == [
        *enumerate(texts)
    ]
    assert [c["finish_reason"] for c in whole["choices"]] == ["length"] * 3
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    ids = [gen.request_id for gen in dispatcher.requests[:3]]
    assert ids == [f"{whole['id']}-{i}" for i in range(3)]
    assert [gen.sampling.seed for gen in dispatcher.requests] == [7, 8, 9] * 3

    assert streamed.text.endswith("data: [DONE]\n\n")
    *chunks, usage = _events(streamed.text)
    assert usage["usage"]["completion_tokens"] == 9 and not usage["choices"]
    choices = [chunk["choices"][0] for chunk in chunks]
    assert [c["index"] for c in choices][:3] == [0, 1, 2]  # every choice's first chunk, then the rest as they come
    for index, text in enumerate(texts):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["delta"].get("content", "") if chat else c["text"] for c in mine) == text
        assert [c["finish_reason"] for c in mine] == [None, "length"]
        assert not chat or mine[0]["delta"]["role"] == "assistant"
    assert all("usage" not in chunk for chunk in chunks)
    # vLLM's continuous_usage_stats: each chunk with its choice's usage so far (the prompt's tokens and its own)
    *chunks, usage = _events(counted.text)
    assert usage["usage"]["completion_tokens"] == 9
    for index in range(3):
        mine = [chunk["usage"] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert [(u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) for u in mine] == [(5, 1, 6), (5, 3, 8)]
    assert dispatcher.ends == ["finished"] * 9


def _completion_scope() -> dict:
    """An ASGI scope of a POST to /v1/completions, for an app called as a server would (its writes seen each)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"router")],
        "client": ("127.0.0.1", 1),
        "server": ("router", 80),
    }


async def _streamed_writes(app, body: dict, send=None) -> list[bytes]:
    """The bodies `app` writes for a streamed completion of `body`, one a write (`send`: the server's, else each
    noted at once)."""
    import asyncio

    writes: list[bytes] = []
    requested = asyncio.Event()
    ended = asyncio.Event()

    async def receive():
        if not requested.is_set():
            requested.set()
            return {"type": "http.request", "body": json.dumps(body | {"stream": True}).encode(), "more_body": False}
        await ended.wait()
        return {"type": "http.disconnect"}

    async def noted(message):
        if message["type"] == "http.response.body" and message["body"]:
            writes.append(message["body"])

    async def sent(message):
        await (send or noted)(message)
        if message["type"] == "http.response.body" and message["body"] and send is not None:
            writes.append(message["body"])

    try:
        await asyncio.wait_for(app(_completion_scope(), receive, sent), 10)
    finally:
        ended.set()
    return writes


@pytest.mark.parametrize("n", [1, 3])
async def test_a_client_gone_mid_stream_closes_every_choice_and_ends_the_request(n):
    """Starlette cancels the stream's task at every await once the client is gone (anyio's cancel scope):
    the cleanup still closes each choice's stream (the dispatcher's abort to its worker) and counts the
    request as ended (it was left running in the metrics, found on `make run`)."""
    import asyncio

    dispatcher, client = _router([[i] for i in range(100_000)])
    app = client._transport.app
    sent: list[dict] = []
    body = json.dumps({"model": "m", "prompt": "hi", "n": n, "stream": True}).encode()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        while len(sent) < 50:  # chunks flowing: then the client hangs up
            await asyncio.sleep(0.001)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(app(_completion_scope(), receive, send), 10)
    assert dispatcher.ends == ["closed"] * n
    async with client:
        samples = _samples((await client.get("/metrics")).text)
    assert samples["vllm:num_requests_running{model_name=m}"] == 0
    assert samples["vllm:request_success_total{finished_reason=abort,model_name=m}"] == n
    assert samples["llmesh_requests_total{endpoint=/v1/completions,status=499}"] == 1


async def test_each_request_is_counted_once_by_its_route_and_the_status_it_ended_with():
    """`llmesh_requests_total`: a stream failed midway under its error's status (it began as a 200), a refusal
    under its own, the body limit's too; probes and scrapes are not counted."""
    dispatcher, client = _router([[1], [2]], max_request_bytes=4096)
    body = {"model": "m", "prompt": "hi"}
    async with client:
        for stream in (False, True):
            assert (await client.post("/v1/completions", json=body | {"stream": stream})).status_code == 200
        dispatcher.lost_after = 1
        failed = await client.post("/v1/completions", json=body | {"stream": True})
        assert (await client.post("/v1/completions", json=body)).status_code == 502
        assert (await client.post("/v1/completions", json={"model": "m"})).status_code == 400
        assert (await client.post("/v1/completions", json=body | {"model": "nobody's"})).status_code == 404
        assert (await client.post("/v1/completions", json=body | {"prompt": "x" * 4096})).status_code == 413
        await client.get("/health")
        await client.get("/metrics")
        text = (await client.get("/metrics")).text
    assert failed.status_code == 200 and '"code":"worker_lost"' in failed.text
    counted = {k: v for k, v in _samples(text).items() if k.startswith("llmesh_requests_total")}
    assert counted == {
        f"llmesh_requests_total{{endpoint=/v1/completions,status={status}}}": count
        for status, count in [(200, 2), (502, 2), (400, 1), (404, 1), (413, 1)]
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_a_choice_refused_before_its_first_token_refuses_the_request_and_closes_the_others(stream):
    dispatcher, client = _router([[1], [2]])
    dispatcher.refused_suffix = "-1"
    dispatcher.pause_s = 0.05  # the others still running when it is refused (each choice runs in a task of its own)
    async with client:
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 3, "stream": stream})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "at_capacity"
        text = (await client.get("/metrics")).text
    assert dispatcher.ends and set(dispatcher.ends) == {"closed"}  # the workers are told to abort
    assert _samples(text)["vllm:num_requests_running{model_name=m}"] == 0


async def test_several_prompts_each_with_n_choices_in_vllms_order():
    dispatcher, client = _router([[1], [2]])
    async with client:
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": [[4, 5], [6]], "n": 2, "seed": 1})
        one = await client.post("/v1/completions", json={"model": "m", "prompt": ["only"]})
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["<1><1>", "<2><2>"] * 2  # each prompt's choices: seed + j
    assert [(g.prompt_token_ids, g.sampling.seed) for g in dispatcher.requests[:4]] == [
        ([4, 5], 1),
        ([4, 5], 2),
        ([6], 1),
        ([6], 2),
    ]
    assert body["usage"] == {"prompt_tokens": 2 * 5, "completion_tokens": 4 * 2, "total_tokens": 18}
    assert dispatcher.requests[4].prompt == "only" and dispatcher.requests[4].request_id == one.json()["id"]


@pytest.mark.parametrize(
    "fields",
    [{"n": 0}, {"n": 129}, {"n": 2, "seed": 2**63 - 1}, {"n": 128, "prompt": ["a", "b", "c"]}],
)
def test_n_out_of_range_too_many_generations_or_seeds_past_64_bits_are_refused(fields):
    from pydantic import ValidationError

    from llmesh.wire.errors import InvalidRequest
    from llmesh_router.schemas import CompletionRequest

    with pytest.raises((ValidationError, InvalidRequest)):
        CompletionRequest(**{"model": "m", "prompt": "hi", **fields})
    assert CompletionRequest(model="m", prompt="hi", n=2, seed=2**63 - 2).choice_samplings()[1].seed == 2**63 - 1
    assert [o.seed for o in CompletionRequest(model="m", prompt="hi", n=2).choice_samplings()] == [None, None]


async def test_cancel_and_wait_waits_for_the_tasks_cleanup_through_its_callers_own_cancellation():
    """anyio cancels a task again at every await (Starlette's, once a client is gone): the tasks still end
    before the caller's cancellation goes on, so nothing they hold (a stream they are inside) is left."""
    import asyncio

    from llmesh.wire.lifecycle import cancel_and_wait

    cleaned = asyncio.Event()

    async def holds_a_stream():
        try:
            await asyncio.sleep(10)
        finally:
            for _ in range(5):  # a cleanup that awaits (an abort sent to a worker)
                await asyncio.sleep(0)
            cleaned.set()

    async def caller(task):
        await cancel_and_wait(task)

    held = asyncio.create_task(holds_a_stream())
    await asyncio.sleep(0)
    outer = asyncio.create_task(caller(held))
    for _ in range(3):  # cancelled again and again, as anyio does
        await asyncio.sleep(0)
        outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert cleaned.is_set() and held.cancelled()


async def test_a_silent_stream_gets_a_keepalive_each_period_and_loses_no_delta(monkeypatch):
    from llmesh_router import serving

    monkeypatch.setattr(serving, "SSE_KEEPALIVE_S", 0.1)
    dispatcher, client = _router([[1], [2]])
    dispatcher.pause_s = 0.25  # two periods of silence after the first
    writes = await _streamed_writes(client._transport.app, {"model": "m", "prompt": "hi"})
    assert writes.count(b": keep-alive\n\n") == 2
    assert "".join(c["choices"][0]["text"] for c in _events(b"".join(writes).decode()) if c["choices"]) == "xx"


async def test_deltas_come_in_one_turn_are_one_write_and_a_choice_s_join_into_one_chunk():
    """As one bus message brings several tokens of a stream the router fell behind on: one chunk of them, one
    write; the choices' first chunks go together before."""
    dispatcher, client = _router([[1], [2], [3], [4]])
    dispatcher.together = True
    writes = await _streamed_writes(client._transport.app, {"model": "m", "prompt": "hi", "n": 2})
    first, rest, end = writes
    assert [c["choices"][0]["index"] for c in _events(first.decode())] == [0, 1]
    joined = [c["choices"][0] for c in _events(rest.decode())]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in joined] == [(0, "xxx", "length"), (1, "xxx", "length")]
    assert end.endswith(b"data: [DONE]\n\n")


async def test_a_client_slow_to_read_gets_what_came_meanwhile_joined_in_order_and_nothing_lost():
    """The server's send waits (its flow control: the client's socket is full): the deltas wait and join, and go
    in one write once it has taken the one before."""
    import asyncio

    dispatcher, client = _router([[i] for i in range(20)])
    drained = asyncio.Event()
    writes_seen = 0

    async def slow(message):  # the second body write waits until a few deltas have piled up behind it
        nonlocal writes_seen
        if message["type"] == "http.response.body" and message["body"]:
            writes_seen += 1
            if writes_seen == 2:
                asyncio.get_running_loop().call_later(0.05, drained.set)
                await drained.wait()

    writes = await _streamed_writes(client._transport.app, {"model": "m", "prompt": "hi"}, send=slow)
    texts = [c["choices"][0]["text"] for w in writes for c in _events(w.decode()) if c["choices"]]
    assert "".join(texts) == "x" * 20 and len(texts) < 20 and len(writes) < 20  # joined while it waited
    assert dispatcher.ends == ["finished"]


async def test_a_send_that_does_not_wait_is_done_at_once_and_one_that_waits_is_left_to_await():
    import asyncio

    from llmesh_router.asgi import sent_now

    got: list[dict] = []

    async def at_once(message):
        got.append(message)

    assert sent_now(at_once, {"n": 1}) is None and got == [{"n": 1}]

    room = asyncio.Event()

    async def waits(message):
        await room.wait()
        got.append(message)

    rest = sent_now(waits, {"n": 2})
    assert rest is not None and got == [{"n": 1}]
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0.01)
    room.set()
    await task
    assert got == [{"n": 1}, {"n": 2}]

    room.clear()
    cancelled = asyncio.ensure_future(sent_now(waits, {"n": 3}))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert got == [{"n": 1}, {"n": 2}]


async def test_coalesced_joins_runs_of_one_choice_s_deltas_that_continue_each_other():
    from llmesh.wire.messages import TokenDelta
    from llmesh_router.serving import coalesced

    batch = [
        (
            0,
            TokenDelta(
                text=f"t{i}", token_ids=[i], completion_tokens=i + 1, finish_reason="length" if i == 2 else None
            ),
        )
        for i in range(3)
    ]
    [(index, joined)] = coalesced(batch)
    assert (index, joined.text, joined.token_ids, joined.completion_tokens, joined.finish_reason) == (
        0,
        "t0t1t2",
        [0, 1, 2],
        3,
        "length",
    )
    # a finished delta, one that opens a stream, or logprobs on one side only: not joined
    done, opening = (
        TokenDelta(text="a", token_ids=[1], finish_reason="stop"),
        TokenDelta(text="b", token_ids=[2], cached_tokens=0),
    )
    with_logprobs = TokenDelta(text="c", token_ids=[3], logprobs=[[(3, -0.1, "c")]])
    assert not done.continued_by(joined) and not joined.model_copy(update={"finish_reason": None}).continued_by(opening)
    assert not TokenDelta(text="d", token_ids=[4]).continued_by(with_logprobs)
    assert TokenDelta.joined([with_logprobs, with_logprobs]).logprobs == [[(3, -0.1, "c")]] * 2
    assert len(coalesced([(0, TokenDelta(text="x", token_ids=[5])), (1, TokenDelta(text="y", token_ids=[6]))])) == 2


async def test_fields_that_change_the_output_and_are_not_done_are_a_400_naming_them_never_ignored():
    from llmesh_router.schemas import UNSUPPORTED

    refused = {
        "best_of": 2,
        "use_beam_search": True,
        "suffix": "end",
        "guided_json": {},
        "guided_regex": "a+",
        "guided_choice": ["a"],
        "guided_grammar": "root ::= a",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "required",
        "chat_template": "{{ messages }}",
        "watermarking": {"key": 1},
        "prompt_embeds": "AAAA",
        "vllm_xargs": {"a": 1},
    }
    assert set(refused) == set(UNSUPPORTED)
    _, client = _router([[1]])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    completion, chat_path = {"model": "m", "prompt": "hi"}, "/v1/chat/completions"
    async with client:
        for name, value in refused.items():
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                if (name, path) in (("tools", chat_path), ("tool_choice", chat_path)):
                    continue  # done there (tools: test_tools.py)
                resp = await client.post(path, json=body | {name: value})
                error = resp.json()["error"]
                assert resp.status_code == 400 and error["param"] == name and name in error["message"], resp.text
        defaults = {name: accepted[0] for name, (accepted, _) in UNSUPPORTED.items() if accepted} | {
            "presence_penalty": None,  # null is 0, OpenAI's default
            "user": "someone",  # and fields that change nothing are ignored
        }
        for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            resp = await client.post(path, json=body | defaults)
            assert resp.status_code == 200, resp.text
        for bad in ({"min_tokens": 2, "stop": "x"}, {"min_tokens": 5, "max_tokens": 4}):
            resp = await client.post("/v1/completions", json=completion | bad)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "min_tokens", resp.text
        resp = await client.post("/v1/completions", json=completion | {"stream_options": {"include_usage": True}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options", resp.text


async def test_return_prompt_text_shows_a_chats_rendered_prompt_on_its_answer_or_first_chunk_alone():
    dispatcher, client = _router([[1], [2], [3]])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "return_prompt_text": True}
    async with client:
        whole = (await client.post("/v1/chat/completions", json=chat)).json()
        streamed = await client.post("/v1/chat/completions", json=chat | {"stream": True})
        plain = (await client.post("/v1/chat/completions", json=chat | {"return_prompt_text": False})).json()
        completion = await client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi", "return_prompt_text": True}
        )
    assert [g.sampling.prompt_text for g in dispatcher.requests] == [True, True, False, False]
    assert whole["prompt_text"] == "<rendered>" and "prompt_text" not in plain
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    first, *rest = [c.get("prompt_text") for c in chunks]  # (the later deltas may come joined)
    assert first == "<rendered>" and rest and not any(rest)
    assert completion.status_code == 200 and "prompt_text" not in completion.json()  # (vLLM's: not a completion's)


async def test_a_chats_echo_begins_its_answer_with_the_last_message_where_its_role_is_the_answers():
    _, client = _router([[1], [2], [3]])
    history = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    async with client:
        answers = []
        for fields in (continued, {}, {"messages": history[:1]}, {"echo": False} | continued):
            body = {"model": "m", "messages": history, "echo": True} | fields
            whole = (await client.post("/v1/chat/completions", json=body)).json()
            streamed = await client.post("/v1/chat/completions", json=body | {"stream": True})
            chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert text == whole["choices"][0]["message"]["content"], fields
            answers.append(text)
    # (vLLM's: the last message's role is the answer's with a generation prompt only where it is the assistant's)
    assert answers == ["Once uponxxx", "Once uponxxx", "xxx", "xxx"]


def test_chat_template_variables_merge_as_vllms_server_merges_them():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

    from llmesh_router.schemas import ChatCompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Su"}]}
    for fields in (
        {},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"chat_template_kwargs": {"enable_thinking": False, "add_generation_prompt": False, "x": 1}},
        {"reasoning_effort": "none", "documents": [{"title": "a", "text": "b"}]},
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
    ):
        theirs = VllmRequest(**chat, **fields).build_chat_params(None, "string").chat_template_kwargs
        ours = ChatCompletionRequest(**chat, **fields).inputs()[0].template_kwargs
        assert ours == {k: v for k, v in theirs.items() if v is not None}, fields
    for bad, param in (
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt's default
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ):
        with pytest.raises(InvalidRequest) as error:
            ChatCompletionRequest(**chat, **bad)
        assert error.value.param == param


def test_add_special_tokens_allowed_token_ids_and_token_ids_as_logprob_tokens():
    from llmesh.engine.worker import sampling_params
    from llmesh_router.schemas import ChatCompletionRequest, CompletionRequest

    assert CompletionRequest(model="m", prompt=["a"]).inputs()[0].add_special_tokens is True
    assert CompletionRequest(model="m", prompt=[[1]]).inputs()[0].add_special_tokens is None  # (ids: as given)
    assert CompletionRequest(model="m", prompt="a", add_special_tokens=False).inputs()[0].add_special_tokens is False
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**chat).inputs()[0].add_special_tokens is False
    options = CompletionRequest(model="m", prompt="a", allowed_token_ids=[5, 7]).sampling()
    assert sampling_params(options, max_tokens=3, kv_transfer_params={}).allowed_token_ids == [5, 7]
    with pytest.raises(ValueError):
        CompletionRequest(model="m", prompt="a", allowed_token_ids=[])
    steps = [[(5, -0.5, "a"), (5, -0.5, "a"), (7, -1.0, "b")]]
    chat_lp = ResponseShape(True, "id", "m", logprobs=1, tokens_as_ids=True)._logprobs(steps, 0)
    assert chat_lp["content"][0]["token"] == "token_id:5"
    assert [e["token"] for e in chat_lp["content"][0]["top_logprobs"]] == ["token_id:5"]
    text_lp = ResponseShape(False, "id", "m", logprobs=2, tokens_as_ids=True)._logprobs(steps, 0)
    assert text_lp["tokens"] == ["token_id:5"] and text_lp["top_logprobs"] == [{"token_id:5": -0.5, "token_id:7": -1.0}]


async def test_tokenize_asks_a_worker_for_the_prompt_a_generation_of_the_same_fields_gets():
    from llmesh_router.schemas import ChatCompletionRequest

    dispatcher, client = _router([[1]])
    chat = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "documents": [{"text": "d"}],
        "reasoning_effort": "none",
        "chat_template_kwargs": {"x": 1},
        "add_special_tokens": True,
    }
    async with client:
        chat_answer = await client.post("/tokenize", json={"model": "m", **chat, "return_token_strs": True})
        text_answer = await client.post("/tokenize", json={"model": "n", "prompt": "hi", "add_special_tokens": False})
        detokenized = await client.post("/detokenize", json={"model": "m", "tokens": [3, 4]})
        cards = (await client.get("/v1/models")).json()["data"]
    assert chat_answer.json() == {"count": 3, "max_model_len": 64, "tokens": [7, 8, 9], "token_strs": ["a", "b", "c"]}
    assert text_answer.json()["token_strs"] is None and detokenized.json() == {"prompt": "3 4"}
    chat_query, text_query, detokenize_query = dispatcher.tokenizer_queries
    generation = ChatCompletionRequest(model="m", **chat).inputs()[0]
    assert chat_query.model_dump() == {"model": "m", **generation._asdict(), "token_strs": True} | {
        "messages": [m.model_dump() for m in generation.messages]
    }
    assert (text_query.model, text_query.prompt, text_query.add_special_tokens) == ("n", "hi", False)
    assert (detokenize_query.model, detokenize_query.tokens) == ("m", [3, 4])
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == [("m", "m", 64), ("n", "n", 64)]


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "hi"}, 400, "model"),  # two models: it must say which
        ("/tokenize", {"model": "x", "prompt": "hi"}, 404, "model"),
        ("/tokenize", {"model": "m"}, 400, "prompt"),
        ("/tokenize", {"model": "m", "prompt": 3}, 400, "prompt"),
        ("/tokenize", {"model": "m", "messages": []}, 400, "messages"),
        (
            "/tokenize",
            {"model": "m", "messages": [{"role": "user"}], "add_generation_prompt": "maybe"},
            400,
            "add_generation_prompt",
        ),
        ("/tokenize", {"model": "m", "messages": [{"role": "user"}], "chat_template": "{{1}}"}, 400, "chat_template"),
        (
            "/tokenize",
            {"model": "m", "messages": [{"role": "user"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", b'{"model": "m", "prompt": "\\ud800"}', 400, None),  # a lone surrogate
        ("/detokenize", {"model": "m", "tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"model": "m", "tokens": [0] * ((1 << 18) + 1)}, 400, "tokens"),
    ],
)
async def test_a_bad_tokenize_or_detokenize_body_is_a_typed_error_naming_its_field(path, body, status, param):
    dispatcher, client = _router([[1]])
    async with client:
        answer = await client.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), answer.text
    if status == 404:
        return
    assert not dispatcher.tokenizer_queries


async def test_a_body_over_the_routers_limit_is_a_413_declared_or_streamed_and_one_under_it_is_served():
    import json

    limit = 4096
    dispatcher, client = _router([[1]], max_request_bytes=limit)
    small = json.dumps({"model": "m", "prompt": "hi"}).encode()
    large = json.dumps({"model": "m", "prompt": "x" * limit}).encode()

    async def streamed(body: bytes):  # no Content-Length: sent chunked
        for at in range(0, len(body), 1000):
            yield body[at : at + 1000]

    async with client:
        answers = [
            await client.post("/v1/completions", content=large, headers={"content-type": "application/json"}),
            await client.post("/v1/completions", content=streamed(large), headers={"content-type": "application/json"}),
            await client.post("/tokenize", content=large, headers={"content-type": "application/json"}),
        ]
        served = await client.post(
            "/v1/completions", content=streamed(small), headers={"content-type": "application/json"}
        )
        metrics = (await client.get("/metrics")).text
    for answer in answers:
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["code"] == "request_too_large"
    assert served.status_code == 200 and len(dispatcher.requests) == 1 and not dispatcher.tokenizer_queries
    assert 'llmesh_requests_total{endpoint="/v1/completions",status="413"} 2.0' in metrics


def test_thinking_token_budget_is_read_as_vllms_server_reads_it_and_reaches_the_engines_sampling():
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import validate_thinking_token_budget

    from llmesh.engine.worker import sampling_params
    from llmesh_router.schemas import ChatCompletionRequest, CompletionRequest

    with pytest.raises(InvalidRequest):  # (vLLM takes it; MessagePack's integers, on the bus, do not)
        CompletionRequest(model="m", prompt="hi", thinking_token_budget=2**63)
    for value in (None, -1, 0, 1, 512, -2, True, False, 2.0, "3"):
        try:
            theirs = validate_thinking_token_budget(value)
        except VLLMValidationError:
            theirs = "refused"
        for request in (CompletionRequest, ChatCompletionRequest):
            fields = (
                {"prompt": "hi"} if request is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
            )
            try:
                options = request(model="m", thinking_token_budget=value, **fields).sampling()
            except InvalidRequest as refused:
                assert theirs == "refused" and refused.param == "thinking_token_budget", value
                continue
            assert options.thinking_token_budget == theirs, value
            params = sampling_params(options, max_tokens=4, kv_transfer_params={})
            assert params.thinking_token_budget == theirs


@pytest.mark.parametrize("own_rank", [1, 3, 7])  # the prompt's token: the likeliest, among the likeliest, beyond them
def test_prompt_logprobs_show_as_vllms_server_shows_them(own_rank):
    """The engine's prompt logprobs (the prompt's token first with its rank, then the likeliest, merged) through
    a worker's delta to the choice and the chat's envelope, as vLLM's server shows them (-inf as -9999.0)."""
    from types import SimpleNamespace

    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
    from vllm.logprobs import Logprob

    from llmesh.engine.detokenizer import prompt_logprob_fields
    from llmesh.wire.messages import TokenDelta

    likeliest = [(50, -0.5), (51, -1.0), (52, -2.0)]
    own = likeliest[own_rank - 1] if own_rank <= len(likeliest) else (60, float("-inf"))
    step = {own[0]: Logprob(own[1], own_rank, f"t{own[0]}")}
    step.update({t: Logprob(lp, r, f"t{t}") for r, (t, lp) in enumerate(likeliest, 1)})
    engine = [None, step, {50: Logprob(-0.1, 1, "t50"), 51: Logprob(-3.0, 2, "t51")}]
    ids, tokenizer = [1, own[0], 50], SimpleNamespace(decode=lambda token: f"t{token}")
    delta = TokenDelta(text="x", token_ids=[9], **prompt_logprob_fields(tokenizer, ids, engine))
    choice = Choice.of([delta])
    vllms = CompletionResponseChoice(index=0, text="x", prompt_logprobs=clamp_prompt_logprobs(engine))
    expected = json.loads(vllms.model_dump_json())["prompt_logprobs"]
    assert choice.prompt_logprobs == expected and [list(s or ()) for s in choice.prompt_logprobs] == [
        list(s or ()) for s in expected
    ]
    assert ResponseShape(False, "r", "m").final([choice], 3)["choices"][0]["prompt_logprobs"] == expected
    assert ResponseShape(True, "r", "m").final([choice], 3)["prompt_logprobs"] == expected
    plain = Choice.of([TokenDelta(text="x", token_ids=[9])])
    assert "prompt_logprobs" not in ResponseShape(False, "r", "m").final([plain], 3)["choices"][0]


@pytest.mark.parametrize(
    "asked, stream, refused",
    [(0, True, None), (5, False, None), (20, False, None), (1, True, "not available when `stream=True`"),
     (-1, True, "not available"), (-1, False, "greater than max allowed: 20"), (21, False, "greater than max"),
     (-2, False, "a positive value or -1")],
)  # fmt: skip
def test_prompt_logprobs_are_refused_as_vllm_refuses_them(asked, stream, refused):
    from llmesh_router.schemas import ChatCompletionRequest, CompletionRequest

    for body in (
        {"model": "m", "prompt": "p"},
        {"model": "m", "messages": [{"role": "user", "content": "p"}]},
    ):
        kind = CompletionRequest if "prompt" in body else ChatCompletionRequest
        try:
            request = kind.model_validate(body | {"prompt_logprobs": asked, "stream": stream})
        except InvalidRequest as exc:
            assert refused is not None and refused in str(exc) and exc.param == "prompt_logprobs"
        else:
            assert refused is None and request.sampling().prompt_logprobs == asked
