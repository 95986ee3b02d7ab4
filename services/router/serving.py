"""The generation endpoints' work behind their routes (as vLLM's `OpenAIServingChat`/`OpenAIServingCompletion`): a
body becomes its generations through the dispatcher, one stream a choice, whose deltas become the answer, whole or
streamed."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from llmesh.wire import telemetry
from llmesh.wire.errors import MeshError
from llmesh.wire.lifecycle import Channel, cancel_and_wait
from llmesh.wire.messages import LoraAdapter, SamplingOptions, TokenDelta

from .asgi import RECEIVED_AT, EventStream, answered, endpoint
from .auth import ApiKey
from .dispatch import Dispatcher, Generation
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
        choices = [
            ChoiceStream(self.dispatcher.generate(gen, parent), self.metrics.request(model, arrival))
            for gen in self._generations(body, request_id, model, lora, samplings, arrival, wait_s)
        ]
        answer = _Answer(request, body, shape, choices, span, self.metrics)
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
        return EventStream(answer.events(client_gone, kept), client_gone, headers=headers)

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


_NO_DELTA = TokenDelta(text="", token_ids=[])  # a choice's first and latest before its first comes


class ChoiceStream:
    """One choice as it streams: its deltas from the dispatcher, its metrics, its first delta (echoed where its
    prompt is) and its latest."""

    __slots__ = ("deltas", "times", "first", "last")

    def __init__(self, deltas: AsyncGenerator[TokenDelta, None], times: RequestTimes):
        self.deltas, self.times = deltas, times
        self.first = self.last = _NO_DELTA


class _Answer:
    """One request's answer as it is made from its choices' streams, and its end: once, whichever way it comes."""

    def __init__(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        shape: ResponseShape,
        choices: list[ChoiceStream],
        span: trace.Span,
        metrics: RouterMetrics,
    ):
        self.request, self.body, self.shape, self.choices, self.span = request, body, shape, choices, span
        self.metrics = metrics
        self.prompts = choices[:: body.n]  # each prompt's first choice, whose deltas tell its tokens once
        self.done = False

    async def open(self) -> None:
        """Every choice's first delta, awaited together before answering, so that errors found by the workers
        (context too long, no capacity) still get their proper HTTP status."""
        firsts = await _unless_disconnected(self.request, _first_of_each([c.deltas for c in self.choices]))
        body = self.body
        for choice, first in zip(self.choices, firsts):
            if body.echoes:
                first = echoed(first, prompt_alone=body.max_tokens == 0, with_text=not body.return_token_ids)
            choice.first = choice.last = choice.times.seen(first)

    async def whole(self, kept: Kept | None) -> JSONResponse:
        rests = await _unless_disconnected(self.request, _rest_of_each(self.choices))
        answer = [Choice.of([choice.first, *rest]) for choice, rest in zip(self.choices, rests)]
        prompt_tokens = sum(choice.first.prompt_tokens for choice in self.prompts)
        whole = self.shape.final(answer, prompt_tokens, self.cached_tokens())
        if kept is not None:
            await kept(self.shape)
        self.finish(200)
        return JSONResponse(whole)

    async def events(self, client_gone: asyncio.Future[None], kept: Kept | None) -> AsyncGenerator[bytes, None]:
        """The stream's events, from the choices' first deltas on; an error that ends it is its last event."""
        shape, choices = self.shape, self.choices
        try:
            for index, choice in enumerate(choices):
                yield shape.chunk_event(choice.first, index, first=True)
            async with aclosing(merged([c.deltas for c in choices], SSE_KEEPALIVE_S, client_gone)) as rest:
                async for batch in rest:
                    if batch is None:  # a silence (e.g. waiting for a worker): proxies and clients keep the stream
                        yield b": keep-alive\n\n"
                        continue
                    for index, delta in coalesced(batch):
                        choice = choices[index]
                        choice.last = choice.times.seen(delta)
                        yield shape.chunk_event(delta, index)
            prompt_tokens = sum(choice.last.prompt_tokens for choice in self.prompts)
            completion_tokens = sum(choice.last.completion_tokens for choice in choices)
            ending = shape.stream_end(prompt_tokens, completion_tokens, self.cached_tokens())
            if kept is not None:
                await kept(shape)
            yield ending
            self.finish(200)
        except _ClientGone:
            pass  # (finally: its requests aborted)
        except Exception as exc:  # mid-stream failure: an OpenAI error event, then the end
            error = exc if isinstance(exc, MeshError) else MeshError(f"internal error: {type(exc).__name__}")
            if error is not exc:  # a bug: the client still gets a typed end, not a cut stream
                log.exception("request %s failed mid-stream", shape.id)
            self.metrics.errors.labels(error.code).inc()
            self.finish(error.http_status, exc)
            yield shape.stream_error(error)
        finally:
            await self.close()  # client gone: the dispatcher aborts the requests in their workers
            self.finish(499)

    def cached_tokens(self) -> int:
        """Each prompt's tokens found cached, once (its choices' first deltas tell them)."""
        return sum(choice.first.cached_tokens or 0 for choice in self.prompts)

    def finish(self, status: int, exc: BaseException | None = None) -> None:
        """The request's end, once: each choice's metrics ended (by its finish reason, where it succeeded), the
        status its count takes, its span ended."""
        if self.done:
            return
        self.done = True
        for choice in self.choices:
            reason = choice.last.finish_reason if status == 200 else None
            choice.times.ended(reason or ("abort" if status == 499 else "error"))
        answered(self.request.scope, status)
        self.span.set_attribute("http.status_code", status)
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(trace.StatusCode.ERROR, str(exc))
        self.span.end()

    async def close(self) -> None:
        """A stream closed before its end aborts its request in the worker: shielded (Starlette cancels a stream
        whose client is gone at every await) and bounded."""
        with anyio.move_on_after(CLOSE_STREAMS_S, shield=True):
            for choice in self.choices:
                await choice.deltas.aclose()


async def _first_of_each(streams: Sequence[AsyncIterator[T]]) -> list[T]:
    """The first item of every stream, awaited together; the first to fail stops the others, and its
    error is raised. Each stream is idle when this returns or raises."""
    if len(streams) == 1:
        return [await anext(streams[0])]
    pending = [asyncio.ensure_future(anext(stream)) for stream in streams]
    try:
        await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in pending]
    finally:
        await cancel_and_wait(*pending)


async def _rest_of_each(choices: Sequence[ChoiceStream]) -> list[list[TokenDelta]]:
    """Each choice's deltas after its first, to its end."""
    rests: list[list[TokenDelta]] = [[] for _ in choices]
    async with aclosing(merged([c.deltas for c in choices], None)) as batches:
        async for batch in batches:
            for index, delta in batch or ():
                choice = choices[index]
                choice.last = choice.times.seen(delta)
                rests[index].append(delta)
    return rests


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


async def merged(
    streams: Sequence[AsyncIterator[T]], keepalive_s: float | None, client_gone: asyncio.Future[None] | None = None
) -> AsyncGenerator[list[tuple[int, T]] | None, None]:
    """Every stream's items as (its index, item) as they come, a list of those that are waiting at once (one
    item while the consumer keeps up, several when it is behind), and None after each `keepalive_s` (if any)
    without one. A task a stream pulls it into one queue and one timer a period watches for silence: nothing
    is created per item (a stream's tokens are the router's hottest path). The first stream to fail ends them
    all with its error (after the items that came before it), and `client_gone` done with _ClientGone;
    closing this closes them."""
    loop = asyncio.get_running_loop()
    queue: Channel[tuple[int, T] | None | _Ended] = Channel()
    last_at = loop.time()
    timer: asyncio.TimerHandle | None = None  # the silence watch's next check

    async def pull(index: int, items: AsyncIterator[T]) -> None:
        try:
            async for item in items:
                queue.put((index, item))
            queue.put(_Ended(None))
        except BaseException as exc:  # (cancelled: by the consumer's end, or by a bug that must not hang it)
            queue.put(_Ended(exc))
            raise

    def watch() -> None:
        nonlocal timer
        assert keepalive_s is not None
        silent_s = loop.time() - last_at
        if silent_s >= keepalive_s and queue.empty():
            queue.put(None)
            silent_s = 0.0
        timer = loop.call_later(keepalive_s - silent_s, watch)

    def stop(_: asyncio.Future[None]) -> None:
        queue.put(_Ended(_ClientGone()))

    pullers = [asyncio.create_task(pull(index, stream)) for index, stream in enumerate(streams)]
    if keepalive_s is not None:
        timer = loop.call_later(keepalive_s, watch)
    if client_gone is not None:
        client_gone.add_done_callback(stop)
    try:
        running = len(pullers)
        while running:
            waiting = [await queue.get(), *queue.take_all()]
            batch: list[tuple[int, T]] = []
            for item in waiting:
                if isinstance(item, _Ended):
                    if item.error is not None:
                        if batch:
                            yield batch
                        raise item.error
                    running -= 1
                elif item is not None:
                    batch.append(item)
            if batch:
                last_at = loop.time()
                yield batch
            elif None in waiting:
                yield None
    finally:
        if timer is not None:
            timer.cancel()
        if client_gone is not None:
            client_gone.remove_done_callback(stop)
        await cancel_and_wait(*pullers)


@dataclass(frozen=True, slots=True)
class _Ended:
    """The end of one of `merged`'s streams, or the error that ended it."""

    error: BaseException | None


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
