"""The generation endpoints' work behind their routes (as vLLM's `OpenAIServingChat`/`OpenAIServingCompletion`): a
body becomes its generations through the dispatcher, one stream a choice, whose deltas become the answer, whole or
streamed."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from starlette.types import Send

from llmesh.wire import telemetry
from llmesh.wire.errors import MeshError
from llmesh.wire.lifecycle import cancel_and_wait
from llmesh.wire.messages import LoraAdapter, SamplingOptions, TokenDelta

from .asgi import RECEIVED_AT, EventStream, answered, endpoint, sent_now
from .auth import ApiKey
from .dispatch import Dispatcher, Generation, Sink
from .metrics import RequestTimes, RouterMetrics
from .parsed_output import OutputParsers
from .registry import WorkerRegistry
from .responses import ResponsesRequest, ResponsesShape, ResponseStore, conversation
from .schemas import ChatCompletionRequest, CompletionRequest
from .shapes import Choice, OutputReading, ResponseShape, echoed, error_response

log = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.2
CLOSE_STREAMS_S = 5.0  # the most a request's cleanup (its aborts to the workers) may take once its client is gone
SSE_KEEPALIVE_S = 15.0  # a stream silent this long gets an SSE comment (proxies cut idle streams at 60 s)

Shaped = Callable[[str, OutputReading | None], ResponseShape]  # a request's id and reading -> its objects' builder
Kept = Callable[[ResponseShape], Awaitable[None]]  # awaited with the shape once the whole answer is made


class OpenAIServing:
    """The completion, chat and response endpoints' answers, built once with the mesh's collaborators."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        request_timeout_s: float,
        output_parsers: OutputParsers,
        response_store: ResponseStore,
    ):
        self.dispatcher, self.registry, self.metrics = dispatcher, registry, metrics
        self.request_timeout_s, self.output_parsers, self.stored = request_timeout_s, output_parsers, response_store
        self.tracer = telemetry.tracer("llmesh.router")

    def refused(self, exc: MeshError) -> JSONResponse:
        """The error's answer, its code counted (`llmesh_request_errors_total`)."""
        self.metrics.errors.labels(exc.code).inc()
        return error_response(exc)

    async def respond(self, request: Request, body: ResponsesRequest, key: ApiKey | None) -> Response:
        """OpenAI's Responses API, over the chat path (`responses`): the response continues its previous one's
        conversation, and is kept where it asks to be (and a store is)."""
        owner = key.name if key else ""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = await self.stored.record(body.previous_response_id, owner, "previous_response_id")
            history = previous["conversation"]
        body.store = body.store and self.stored.enabled  # (echoed as it is done)

        async def kept(shape: ResponseShape) -> None:
            assert isinstance(shape, ResponsesShape) and shape.response is not None
            if body.store:
                made = shape.response
                await self.stored.keep(made, conversation(history, body, made), body.input_items(), owner)

        return await self.generate(
            request,
            body.chat(history),
            key,
            shaped=lambda request_id, reading: ResponsesShape(body, request_id, reading),
            kept=kept,
            request_id=f"resp_{uuid.uuid4().hex}",
        )

    async def generate(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        key: ApiKey | None,
        shaped: Shaped | None = None,
        kept: Kept | None = None,
        request_id: str | None = None,
    ) -> Response:
        """`body`'s answer, as the chat or completion endpoint's objects, or as `shaped`'s; `kept` is awaited with
        the shape once the whole answer is made."""
        chat = isinstance(body, ChatCompletionRequest)
        request_id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        samplings = body.choice_samplings()
        model, lora = self.registry.resolve(body.model)  # (an adapter: the model it adapts, and it)
        reading: OutputReading | None = body.tool_calling
        parsed = self.output_parsers.reading(body, model) if isinstance(body, ChatCompletionRequest) else None
        if parsed is not None:
            reading = parsed  # the model's parsers read its output, and may constrain its calls in their format
            samplings = [options.model_copy(update=parsed.sampling_update) for options in samplings]
        now = time.monotonic()
        arrival = request.scope.get("state", {}).get(RECEIVED_AT, now)  # its first byte read (__main__'s protocol)
        wait_s = now - arrival
        self.metrics.http_wait.observe(wait_s)
        span = self._span(request, body, request_id, key, wait_s)
        parent = trace.set_span_in_context(span)
        shape = shaped(request_id, reading) if shaped is not None else _shape(body, request_id, chat, reading)
        answer = _Answer(request, body, shape, span, self.metrics)
        for gen in self._generations(body, request_id, model, lora, samplings, arrival, wait_s):
            answer.run(partial(self.dispatcher.generate, gen, parent), self.metrics.request(model, arrival))
        try:
            await answer.open()
            if not body.stream:
                return await answer.whole(kept)
        except MeshError as exc:
            await answer.close()
            answer.finish(exc.http_status, exc)
            return self.refused(exc)
        except _ClientGone:
            await answer.close()  # the dispatcher aborts the request in the worker
            answer.finish(499)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        except BaseException as exc:
            await answer.close()
            answer.finish(499 if isinstance(exc, asyncio.CancelledError) else 500, exc)
            raise
        client_gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        headers = {"Cache-Control": "no-cache", "X-Request-Id": request_id}
        content = partial(answer.stream, client_gone=client_gone, kept=kept)
        return EventStream(content, answer.close, client_gone, headers)

    def _span(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        key: ApiKey | None,
        wait_s: float,
    ) -> trace.Span:
        """The request's span, from its first byte read (`wait_s` ago)."""
        return self.tracer.start_span(
            "router request",
            kind=trace.SpanKind.SERVER,
            context=telemetry.extract(request.headers),
            start_time=time.time_ns() - int(wait_s * 1e9),
            attributes={
                "request.id": request_id,
                "model": body.model,
                "stream": body.stream,
                "n": body.n,
                "endpoint": endpoint(request.scope),
                "api_key.name": key.name if key else "",
                "http.wait_s": wait_s,
            },
        )

    def _generations(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        model: str,
        lora: LoraAdapter | None,
        samplings: list[SamplingOptions],
        arrival: float,
        wait_s: float,
    ) -> list[Generation]:
        """A generation a choice of each prompt (choice j of prompt i at index i·n + j, as vLLM orders them), each a
        request of its own through the mesh, due `request_timeout_s` after its first byte (`wait_s` ago)."""
        deadline = time.time() - wait_s + self.request_timeout_s
        served = self.registry.catalogue.get(model)  # its targets, where the request sets none
        inputs = body.inputs()
        return [
            Generation(
                request_id=request_id if len(inputs) * body.n == 1 else f"{request_id}-{i * body.n + j}",
                model=model,
                lora=lora,
                **prompt._asdict(),
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                truncation_side=body.truncation_side,
                sampling=options,
                deadline=deadline,
                cache_salt=body.cache_salt,
                priority=body.priority,
                ttft_slo_s=_seconds(body.ttft_slo_ms or (served.ttft_slo_ms if served else None)),
                tpot_slo_s=_seconds(body.tpot_slo_ms or (served.tpot_slo_ms if served else None)),
                arrival=arrival,
            )
            for i, prompt in enumerate(inputs)
            for j, options in enumerate(samplings)
        ]


def _shape(
    body: CompletionRequest | ChatCompletionRequest, request_id: str, chat: bool, reading: OutputReading | None
) -> ResponseShape:
    """The chat or completion endpoint's objects of `body`."""
    return ResponseShape(
        chat,
        request_id,
        body.model,
        body.shown_logprobs,
        reading,
        body.return_tokens_as_token_ids,
        body.return_token_ids,
        body.continuous_usage,
        body.include_usage,
        body.chat_echo,
    )


def _seconds(ms: float | None) -> float | None:
    return ms / 1000 if ms else None


class ChoiceStream:
    """One choice as it streams: the task running it through the mesh (`Dispatcher.generate`, which hands its
    deltas to the answer as they come), its metrics, its first delta (echoed where its prompt is; None until it
    comes) and its latest."""

    __slots__ = ("task", "times", "first", "last")

    def __init__(self, task: asyncio.Task[None], times: RequestTimes):
        self.task, self.times = task, times
        self.first: TokenDelta | None = None
        self.last: TokenDelta | None = None


class _Answer:
    """One request's answer as it is made from its choices' deltas, and its end: once, whichever way it comes.

    Each choice's deltas are pushed to `arrived` from the bus's read of them, and, once the stream is open, those
    come in one turn of the event loop are written together (`_flush`: joined where one choice's follow each
    other, `coalesced`) with the server's `send` run at once (`sent_now`): no task wakes for a token. The request's
    own task waits only for the choices' ends, the client's leaving, and a write the client is slow to take."""

    def __init__(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        shape: ResponseShape,
        span: trace.Span,
        metrics: RouterMetrics,
    ):
        self.request, self.body, self.shape, self.span, self.metrics = request, body, shape, span, metrics
        self.choices: list[ChoiceStream] = []
        self.pending: list[tuple[int, TokenDelta]] = []  # deltas after the choices' first, not yet written
        self.done = False
        self._loop = asyncio.get_running_loop()
        self._unopened = 0  # choices without their first delta
        self._failure: BaseException | None = None  # the first of the choices' (or the writes') errors
        self._news: asyncio.Future[None] | None = None  # the request's task waiting for a choice's first or end
        self._send: Send | None = None  # the server's, once the stream is open (deltas are then written)
        self._flush_due = False
        self._writing: asyncio.Future[None] | None = None  # a write waiting for the client's socket to drain
        self._written_at = 0.0  # (the loop's clock, for the keep-alive)
        self._keepalive: asyncio.TimerHandle | None = None  # its next check, while the stream is open

    @property
    def prompts(self) -> list[ChoiceStream]:
        return self.choices[:: self.body.n]  # each prompt's first choice, whose deltas tell its tokens once

    def run(self, generate: Callable[[Sink], Awaitable[None]], times: RequestTimes) -> None:
        """A choice more, run by `generate(sink)` in a task of its own."""
        task = asyncio.ensure_future(generate(partial(self.arrived, len(self.choices))))
        task.add_done_callback(self._ended)
        self.choices.append(ChoiceStream(task, times))
        self._unopened += 1

    def arrived(self, index: int, delta: TokenDelta) -> None:
        """Choice `index`'s next delta, as it comes (the choices' sink: called on the bus's read, no await)."""
        choice = self.choices[index]
        if choice.first is None:
            if self.body.echoes:
                delta = echoed(delta, prompt_alone=self.body.max_tokens == 0, with_text=not self.body.return_token_ids)
            choice.first = choice.last = choice.times.seen(delta)
            self._unopened -= 1
            if not self._unopened:
                self._notify()
            return
        choice.last = choice.times.seen(delta)
        self.pending.append((index, delta))
        if self._send is not None and not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._failed(task)
        self._notify()

    def _failed(self, task: asyncio.Task[None]) -> None:
        if self._failure is None and task.done() and not task.cancelled():
            self._failure = task.exception()

    def _fail(self, exc: BaseException) -> None:
        """The answer ends with `exc` (unless a choice failed first), told to the request's task."""
        self._failure = self._failure or exc
        self._notify()

    def _notify(self, *_: object) -> None:
        if self._news is not None and not self._news.done():
            self._news.set_result(None)

    async def _until(self, ready: Callable[[], bool]) -> None:
        """Wait until `ready()`; the first of the choices' errors meanwhile is raised (a choice that ended without
        a delta is one)."""
        while True:
            for choice in self.choices:  # (a task's end is known before its callbacks run)
                self._failed(choice.task)
            if self._failure is not None:
                raise self._failure
            if any(c.first is None and c.task.done() for c in self.choices):
                raise MeshError("a choice ended without any output")
            if ready():
                return
            self._news = self._loop.create_future()
            try:
                await self._news
            finally:
                self._news = None

    def _all_ended(self) -> bool:
        return all(choice.task.done() for choice in self.choices)

    async def open(self) -> None:
        """Every choice's first delta, awaited together before answering, so that errors found by the workers
        (context too long, no capacity) still get their proper HTTP status."""
        await _unless_disconnected(self.request, self._until(lambda: not self._unopened))

    async def whole(self, kept: Kept | None) -> JSONResponse:
        await _unless_disconnected(self.request, self._until(self._all_ended))
        rests: list[list[TokenDelta]] = [[] for _ in self.choices]
        for index, delta in self.pending:
            rests[index].append(delta)
        answer = [Choice.of([self._first(c), *rest]) for c, rest in zip(self.choices, rests)]
        prompt_tokens = sum(self._first(choice).prompt_tokens for choice in self.prompts)
        whole = self.shape.final(answer, prompt_tokens, self.cached_tokens())
        if kept is not None:
            await kept(self.shape)
        self.finish(200)
        return JSONResponse(whole)

    async def stream(self, send: Send, client_gone: asyncio.Future[None], kept: Kept | None) -> None:
        """The stream's events written to the server's `send`, from the choices' first deltas on; an error that ends
        it is its last event."""
        shape, choices = self.shape, self.choices
        client_gone.add_done_callback(self._notify)
        self._keepalive = self._loop.call_later(SSE_KEEPALIVE_S, self._keep_alive)
        try:
            self._send = send
            self._write(b"".join(shape.chunk_event(self._first(c), i, first=True) for i, c in enumerate(choices)))
            self._flush()
            await self._until(lambda: client_gone.done() or self._all_ended())
            if client_gone.done():
                raise _ClientGone()
            tail = await self._last_writes()
            prompt_tokens = sum(self._latest(choice).prompt_tokens for choice in self.prompts)
            completion_tokens = sum(self._latest(choice).completion_tokens for choice in choices)
            ending = shape.stream_end(prompt_tokens, completion_tokens, self.cached_tokens())
            if kept is not None:
                await kept(shape)
            await send({"type": "http.response.body", "body": tail + ending, "more_body": True})
            self.finish(200)
        except _ClientGone:
            pass  # (finally: its requests aborted)
        except Exception as exc:  # mid-stream failure: an OpenAI error event, then the end
            error = exc if isinstance(exc, MeshError) else MeshError(f"internal error: {type(exc).__name__}")
            if error is not exc:  # a bug: the client still gets a typed end, not a cut stream
                log.exception("request %s failed mid-stream", shape.id)
            self.metrics.errors.labels(error.code).inc()
            self.finish(error.http_status, exc)
            if not client_gone.done():
                tail = await self._last_writes()
                await send({"type": "http.response.body", "body": tail + shape.stream_error(error), "more_body": True})
        finally:
            self._send = None
            if self._keepalive is not None:
                self._keepalive.cancel()
            client_gone.remove_done_callback(self._notify)
            await self.close()  # client gone: the dispatcher aborts the requests in their workers
            self.finish(499)

    def _flush(self) -> None:
        """The deltas come since the last write, written (once a turn of the loop: `arrived`)."""
        self._flush_due = False
        if self._send is None or self._writing is not None or not self.pending:
            return
        try:
            self._write(self._rendered())
        except Exception as exc:  # (a bug rendering: the stream ends with it)
            self._fail(exc)

    def _rendered(self) -> bytes:
        batch, self.pending = self.pending, []
        return b"".join(self.shape.chunk_event(delta, index) for index, delta in coalesced(batch))

    def _write(self, chunk: bytes) -> None:
        assert self._send is not None and self._writing is None
        if not chunk:
            return
        self._written_at = self._loop.time()
        rest = sent_now(self._send, {"type": "http.response.body", "body": chunk, "more_body": True})
        if rest is not None:  # the client is slow to read: the deltas wait (and join) until it has taken this
            self._writing = asyncio.ensure_future(rest)
            self._writing.add_done_callback(self._wrote)

    def _wrote(self, writing: asyncio.Future[None]) -> None:
        self._writing = None
        if not writing.cancelled() and (exc := writing.exception()) is not None:
            self._fail(exc)
        else:
            self._flush()

    def _keep_alive(self) -> None:
        """A comment where the stream was silent for a period (e.g. waiting for a worker): proxies and clients keep
        it open."""
        silent_s = self._loop.time() - self._written_at
        if silent_s >= SSE_KEEPALIVE_S and self._send is not None and self._writing is None:
            try:
                self._write(b": keep-alive\n\n")
            except Exception as exc:
                self._fail(exc)
            silent_s = 0.0
        if self._send is not None:
            self._keepalive = self._loop.call_later(SSE_KEEPALIVE_S - silent_s, self._keep_alive)

    async def _last_writes(self) -> bytes:
        """What is left to write, once a write the client was slow to take has gone (no more are made at once)."""
        self._send = None
        while self._writing is not None:
            await asyncio.wait({self._writing})
        return self._rendered()

    @staticmethod
    def _first(choice: ChoiceStream) -> TokenDelta:
        assert choice.first is not None  # (opened)
        return choice.first

    @staticmethod
    def _latest(choice: ChoiceStream) -> TokenDelta:
        assert choice.last is not None
        return choice.last

    def cached_tokens(self) -> int:
        """Each prompt's tokens found cached, once (its choices' first deltas tell them)."""
        return sum(choice.first.cached_tokens or 0 for choice in self.prompts if choice.first is not None)

    def finish(self, status: int, exc: BaseException | None = None) -> None:
        """The request's end, once: each choice's metrics ended (by its finish reason, where it succeeded), the
        status its count takes, its span ended."""
        if self.done:
            return
        self.done = True
        for choice in self.choices:
            reason = choice.last.finish_reason if status == 200 and choice.last is not None else None
            choice.times.ended(reason or ("abort" if status == 499 else "error"))
        answered(self.request.scope, status)
        self.span.set_attribute("http.status_code", status)
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(trace.StatusCode.ERROR, str(exc))
        self.span.end()

    async def close(self) -> None:
        """Choices not ended are cancelled, which aborts their requests in the workers: shielded (Starlette cancels
        a stream whose client is gone at every await) and bounded."""
        with anyio.move_on_after(CLOSE_STREAMS_S, shield=True):
            await cancel_and_wait(*(choice.task for choice in self.choices))


def coalesced(batch: list[tuple[int, TokenDelta]]) -> list[tuple[int, TokenDelta]]:
    """A batch of deltas with each run of one choice's joined into one (`TokenDelta.joined`): a stream the router
    fell behind on gets one chunk of several tokens, not a chunk (and a write) a token."""
    if len(batch) == 1:  # (the router keeping up)
        return batch
    runs: list[tuple[int, list[TokenDelta]]] = []
    for index, delta in batch:
        if runs and runs[-1][0] == index and runs[-1][1][-1].continued_by(delta):
            runs[-1][1].append(delta)
        else:
            runs.append((index, [delta]))
    return [(index, TokenDelta.joined(run)) for index, run in runs]


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer began."""


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the HTTP client disconnects first; either way it has ended when
    this returns or raises (so the generator it was advancing can be closed)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise _ClientGone()
        return task.result()
    finally:
        await cancel_and_wait(task)
