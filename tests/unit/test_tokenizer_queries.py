"""/tokenize and /detokenize below the router: a worker answers with the prompt its generation would get
(the same rendering, `PromptRenderer.rendered`), and the router asks an active worker of the model,
passing over one that is gone; a long prompt renders off the worker's event loop."""

import asyncio
import copy
import time

import pytest
from transformers import AutoTokenizer

from llmesh.engine.models import build_tokenizer
from llmesh.engine.prompts import PromptRenderer
from llmesh.engine.worker import EngineWorker
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import InvalidRequest, ModelNotFound, NoResponders, ServiceUnavailable
from llmesh.wire.messages import (
    Ack,
    ChatMessage,
    Detokenized,
    DetokenizeTokens,
    PrefillRequest,
    SamplingOptions,
    Subjects,
    Tokenized,
    TokenizePrompt,
    WorkerInfo,
)

TEXT = "Once upon a time, a fox <|user|> ran."


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> EngineWorker:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    engine_worker = object.__new__(EngineWorker)  # what the tokenizer queries read of an engine's worker
    engine_worker.tokenizer, engine_worker.max_model_len = AutoTokenizer.from_pretrained(path), 64
    engine_worker.prompts = PromptRenderer(engine_worker.tokenizer, 64)
    return engine_worker


def ask(worker: EngineWorker, query):
    return asyncio.run(worker._on_tokenizer(query, memoryview(b"")))


def test_a_worker_tokenizes_each_form_as_it_renders_the_prompt_of_a_generation(worker):
    tok = worker.tokenizer
    for special in (None, True, False):
        got = ask(worker, TokenizePrompt(model="m", prompt=TEXT, add_special_tokens=special))
        assert got == Tokenized(tokens=tok.encode(TEXT, add_special_tokens=special is not False), max_model_len=64)
    messages = [ChatMessage(role="user", content="Hi."), ChatMessage(role="assistant", content="Hello")]
    variables = {"add_generation_prompt": False, "continue_final_message": True}
    chat = ask(worker, TokenizePrompt(model="m", messages=messages, template_kwargs=variables, token_strs=True))
    generation = PrefillRequest(
        request_id="r", model="m", messages=messages, template_kwargs=variables, sampling=SamplingOptions(), deadline=0
    )
    assert chat.tokens == asyncio.run(worker.prompts.prompt_token_ids(generation))
    assert chat.token_strs == tok.convert_ids_to_tokens(chat.tokens) and tok.decode(chat.tokens).endswith("Hello")

    ids = tok.encode(TEXT)
    assert ask(worker, DetokenizeTokens(model="m", tokens=ids)) == Detokenized(text=tok.decode(ids))


def test_a_chats_rendered_prompt_is_shown_where_asked_for_and_an_echo_as_before(worker):
    tok = worker.tokenizer
    long = "word " * 5000  # (over the text rendered inline: in the worker's thread)
    for content in ("Hi.", long):
        messages = [ChatMessage(role="user", content=content)]
        asked = PrefillRequest(
            request_id="r", model="m", messages=messages, sampling=SamplingOptions(prompt_text=True), deadline=0
        )
        ids = asyncio.run(worker.prompts.prompt_token_ids(asked))
        rendered = asyncio.run(worker.prompts.shown_text(asked, ids))
        assert rendered == tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        assert tok.encode(rendered, add_special_tokens=False) == ids
        unasked = asked.model_copy(update={"sampling": SamplingOptions()})
        assert asyncio.run(worker.prompts.shown_text(unasked, ids)) is None
    echo = PrefillRequest(request_id="r", model="m", prompt=TEXT, sampling=SamplingOptions(echo=True), deadline=0)
    assert asyncio.run(worker.prompts.shown_text(echo, tok.encode(TEXT))) == TEXT


@pytest.mark.parametrize(
    "query, param",
    [
        (DetokenizeTokens(model="m", tokens=[1, 10**6]), "tokens"),
        (TokenizePrompt(model="m"), "prompt"),
        (TokenizePrompt(model="m", messages=[]), "messages"),
        (TokenizePrompt(model="m", prompt_token_ids=[-1]), "prompt"),
        (Ack(), None),
    ],
)
def test_a_query_the_worker_cannot_answer_is_a_typed_error(worker, query, param):
    with pytest.raises(InvalidRequest) as refused:
        ask(worker, query)
    assert refused.value.param == param


def test_the_router_asks_an_active_worker_of_the_model_the_least_busy_first_and_passes_over_a_gone_one():
    from llmesh_router.dispatch import Dispatcher
    from llmesh_router.registry import WorkerRegistry

    class Bus:  # the workers' answers: "gone" ones have no responders
        def __init__(self, gone: set[str]):
            self.gone, self.asked = gone, []

        async def request(self, subject, msg, expected, *, timeout):
            self.asked.append(subject)
            if subject.rsplit(".", 1)[1] in self.gone:
                raise NoResponders(f"nothing is serving {subject}")
            return Tokenized(tokens=[1], max_model_len=8), memoryview(b"")

    registry = WorkerRegistry(
        catalogue=[ServedModel(name=name) for name in ("m", "n", "z")]
    )  # z: no worker serves it now
    for worker_id, model, running, state in (
        ("busy", "m", 5, "active"),
        ("idle", "m", 0, "draining"),
        ("free", "m", 1, "active"),
        ("other", "n", 0, "active"),
    ):
        registry.on_heartbeat(
            WorkerInfo(
                worker_id=worker_id,
                role="decode",
                model=model,
                fingerprint="f",
                max_model_len=8,
                running=running,
                queued_tokens=0,
                capacity=8,
                heartbeat_s=1.0,
                state=state,
            )
        )
    query = TokenizePrompt(model="m", prompt="hi")
    for gone, asked in (
        (set(), ["free"]),
        ({"free"}, ["free", "busy"]),
    ):
        dispatcher = object.__new__(Dispatcher)
        dispatcher.bus, dispatcher.registry = Bus(gone), registry
        assert asyncio.run(dispatcher.ask_tokenizer(query, Tokenized)).tokens == [1]
        assert dispatcher.bus.asked == [Subjects.tokenizer(w) for w in asked]
    dispatcher.bus = Bus({"free", "busy"})
    with pytest.raises(NoResponders):
        asyncio.run(dispatcher.ask_tokenizer(query, Tokenized))
    with pytest.raises(ModelNotFound):
        asyncio.run(dispatcher.ask_tokenizer(TokenizePrompt(model="x", prompt="hi"), Tokenized))
    with pytest.raises(ServiceUnavailable, match="no worker serves 'z' now"):
        asyncio.run(dispatcher.ask_tokenizer(TokenizePrompt(model="z", prompt="hi"), Tokenized))


def test_a_long_prompt_is_tokenized_while_the_workers_loop_turns_and_a_cut_leaves_the_shared_tokenizer_as_it_was(
    worker,
):
    tok = worker.tokenizer
    long_text = "hello world " * 200_000  # 400k tokens: about half a second of tokenizing

    async def rendered_while_ticking() -> tuple[list[int], float]:
        gaps, last = [], time.monotonic()

        async def tick():
            nonlocal last
            while True:
                await asyncio.sleep(0.005)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        ids = await worker.prompts.rendered(TokenizePrompt(model="m", prompt=long_text))
        took = time.monotonic() - started
        ticker.cancel()
        assert took > 0.1, took  # long enough that the loop's turns tell
        return ids, max(gaps)

    ids, longest_gap = asyncio.run(rendered_while_ticking())
    assert ids == tok.encode(long_text)
    assert longest_gap < 0.1, longest_gap

    cut = PrefillRequest(
        request_id="r", model="m", prompt=TEXT, truncate_prompt_tokens=4, sampling=SamplingOptions(), deadline=0
    )
    expected = copy.deepcopy(tok).encode(TEXT, truncation=True, max_length=4)
    assert asyncio.run(worker.prompts.prompt_token_ids(cut)) == expected
    assert tok._tokenizer.truncation is None  # (the cut was the copy's)
    assert asyncio.run(worker.prompts.rendered(TokenizePrompt(model="m", prompt=TEXT))) == tok.encode(TEXT)
