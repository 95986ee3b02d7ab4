"""The router's HTTP API: OpenAI-compatible endpoints plus /health and /metrics."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmesh.wire import telemetry
from llmesh.wire.errors import Forbidden, InvalidRequest, MeshError, ModelNotFound, RequestTooLarge
from llmesh.wire.lifecycle import Channel, cancel_and_wait
from llmesh.wire.messages import ROLES, Detokenized, DetokenizeTokens, LoraCommand, TokenDelta, Tokenized

from .auth import ApiKey, KeyRing
from .dispatch import Dispatcher, Generation
from .metrics import RequestTimes, RouterMetrics
from .openai_api import (
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    OutputReading,
    ResponseShape,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    echoed,
    error_response,
    validation_error,
)
from .parsed_output import OutputParsers
from .registry import WorkerRegistry
from .responses import ResponsesRequest, ResponsesShape, ResponseStore, conversation, page

log = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.2
CLOSE_STREAMS_S = 5.0  # the most a request's cleanup (its aborts to the workers) may take once its client is gone
SSE_KEEPALIVE_S = 15.0  # a stream silent this long gets an SSE comment (proxies cut idle streams at 60 s)
RECEIVED_AT = "llmesh.received_at"  # a request scope's state: when its first byte was read (monotonic s)
SERVER_SEND = "llmesh.server_send"  # and the server's `send`, unwrapped by the middlewares (StampedProtocol)


def _seconds(ms: float | None) -> float | None:
    return ms / 1000 if ms else None


def create_app(
    dispatcher: Dispatcher,
    registry: WorkerRegistry,
    metrics: RouterMetrics,
    request_timeout_s: float,
    keys: KeyRing | None = None,
    output_parsers: OutputParsers | None = None,
    max_request_bytes: int = 16 * 2**20,
    response_store: ResponseStore | None = None,
    admin_keys: KeyRing | None = None,
) -> FastAPI:
    """The router's app; with `keys`, every /v1 endpoint needs one of them (/health and /metrics,
    for probes and scrapers, do not: bind them to a private address, as vLLM's server does).
    `output_parsers`: the catalogue's parsers of tool calls and reasoning (none: tool_choice "auto" is refused);
    a body over `max_request_bytes` is a 413; `response_store`: where /v1/responses keeps responses (none: not
    kept); `admin_keys`: the admin endpoints' (none: they are closed)."""
    app = FastAPI(title="llmesh router", version="0.1.0")
    output_parsers = output_parsers or OutputParsers((), Path())
    tracer = telemetry.tracer("llmesh.router")
    keyring = keys or KeyRing(())
    stored = response_store or ResponseStore("", 0)

    async def api_key(request: Request) -> ApiKey | None:  # async: FastAPI runs a plain def in its thread pool
        return keyring.admit(request.headers.get("authorization"))

    async def admin_key(request: Request) -> ApiKey | None:
        if admin_keys is None or not admin_keys.enabled:
            raise Forbidden(
                "The admin endpoints are closed: give the router admin keys (MESH_ADMIN_API_KEYS, or the "
                "secrets' admin-api-keys)."
            )
        return admin_keys.admit(request.headers.get("authorization"))

    def endpoint(scope: Scope) -> str:
        """What a request's metrics count it under: its route's path (one label however many ids its paths
        hold), or "unmatched" (a label per unknown path would grow without bound)."""
        route = scope.get("route")
        if route is None:  # (not routed yet: refused by the body limit)
            route = next((r for r in app.router.routes if r.matches(scope)[0] == Match.FULL), None)
        return route.path if isinstance(route, Route) else "unmatched"

    def counted_error(exc: MeshError, scope: Scope) -> JSONResponse:
        metrics.requests.labels(endpoint(scope), str(exc.http_status)).inc()
        metrics.errors.labels(exc.code).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return counted_error(validation_error(list(exc.errors())), request.scope)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = InvalidRequest(str(exc.detail))
        err.http_status = exc.status_code
        return counted_error(err, request.scope)

    @app.exception_handler(MeshError)
    async def on_mesh_error(request: Request, exc: MeshError) -> JSONResponse:
        return counted_error(exc, request.scope)

    app.add_middleware(_BodyLimit, limit=max_request_bytes, refused=counted_error)

    @app.get("/health")
    async def health() -> JSONResponse:
        counts = {role: len(registry.live(role)) for role in ROLES}
        ok = bool(registry.served())
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "workers": counts, "models": registry.models()},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        for role in ROLES:
            metrics.workers.labels(role).set(len(registry.live(role)))
        metrics.set_request_states(registry.models())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(api_key)])
    async def models() -> dict[str, Any]:
        """vLLM's model cards; `max_model_len` where a live worker has told it (null: none serves it now)."""
        context: dict[str, int] = {}
        for worker in registry.live():
            context[worker.model] = min(context.get(worker.model, worker.max_model_len), worker.max_model_len)
        cards = [
            {"id": m, "object": "model", "created": 0, "owned_by": "llmesh", "root": m, "max_model_len": context.get(m)}
            for m in registry.models()
        ]
        cards += [  # (vLLM's cards of LoRA adapters: their folder as `root`, their model as `parent`)
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "llmesh",
                "root": adapter.path,
                "parent": model,
                "max_model_len": context.get(model),
            }
            for name, (model, adapter) in sorted(registry.adapters().items())
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(admin_key)])
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        """vLLM's: load a LoRA adapter on every live worker of its model (the mesh's only one, unless
        `base_model_name` names it), which serve it from then on (as does any that gets a request for it)."""
        model = model_named(body.base_model_name)
        if registry.knows(body.lora_name) or body.lora_name in registry.adapters():
            raise InvalidRequest(f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        await dispatcher.command_adapter(model, LoraCommand(op="load", adapter=body.adapter()))
        metrics.requests.labels("/v1/load_lora_adapter", "200").inc()
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(admin_key)])
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        adapted = registry.adapters().get(body.lora_name)
        if adapted is None:
            raise ModelNotFound(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
        model, adapter = adapted
        await dispatcher.command_adapter(model, LoraCommand(op="unload", adapter=adapter))
        metrics.requests.labels("/v1/unload_lora_adapter", "200").inc()
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    def model_named(name: str | None) -> str:
        """A request's model (a LoRA adapter's: the model it adapts); where it names none (vLLM's tokenizer
        endpoints allow that), the mesh's only one."""
        if name is not None:
            return registry.resolve(name)[0]
        if len(known := registry.models()) != 1:
            raise InvalidRequest(f"`model` is required: the mesh has {', '.join(known) or 'none'}", param="model")
        return known[0]

    @app.post("/tokenize", dependencies=[Depends(api_key)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """The prompt's token ids as a generation of the same fields gets them (vLLM's /tokenize): a worker
        of the model renders and tokenizes it."""
        tokenized = await dispatcher.ask_tokenizer(body.query(model_named(body.model)), Tokenized)
        metrics.requests.labels("/tokenize", "200").inc()
        return {
            "count": len(tokenized.tokens),
            "max_model_len": tokenized.max_model_len,
            "tokens": tokenized.tokens,
            "token_strs": tokenized.token_strs,
        }

    @app.post("/detokenize", dependencies=[Depends(api_key)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        query = DetokenizeTokens(model=model_named(body.model), tokens=body.tokens)
        detokenized = await dispatcher.ask_tokenizer(query, Detokenized)
        metrics.requests.labels("/detokenize", "200").inc()
        return {"prompt": detokenized.text}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, key: ApiKey | None = Depends(api_key)) -> Response:
        return await generate(request, body, key, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, key: ApiKey | None = Depends(api_key)
    ) -> Response:
        return await generate(request, body, key, chat=True)

    @app.post("/v1/responses")
    async def create_response(
        body: ResponsesRequest, request: Request, key: ApiKey | None = Depends(api_key)
    ) -> Response:
        """OpenAI's Responses API, over the chat path (`responses`)."""
        owner = key.name if key else ""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = (await stored.record(body.previous_response_id, owner, "previous_response_id"))["conversation"]
        body.store = body.store and stored.enabled  # (echoed as it is done)
        chat = body.chat(history)

        async def kept(shape: ResponseShape) -> None:
            assert isinstance(shape, ResponsesShape) and shape.response is not None
            if body.store:
                made = shape.response
                await stored.keep(made, conversation(history, body, made), body.input_items(), owner)

        return await generate(
            request,
            chat,
            key,
            chat=True,
            shaped=lambda request_id, reading: ResponsesShape(body, request_id, reading),
            kept=kept,
            request_id=f"resp_{uuid.uuid4().hex}",
        )

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, key: ApiKey | None = Depends(api_key)) -> dict[str, Any]:
        response: dict[str, Any] = (await stored.record(response_id, key.name if key else ""))["response"]
        metrics.requests.labels("/v1/responses/{response_id}", "200").inc()
        return response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        key: ApiKey | None = Depends(api_key),
    ) -> dict[str, Any]:
        """A stored response's input items (OpenAI's list, newest first by default)."""
        items = (await stored.record(response_id, key.name if key else ""))["input_items"]
        listed = page(items, after, limit, order)
        metrics.requests.labels("/v1/responses/{response_id}/input_items", "200").inc()
        return listed

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, key: ApiKey | None = Depends(api_key)) -> dict[str, Any]:
        await stored.delete(response_id, key.name if key else "")
        metrics.requests.labels("/v1/responses/{response_id}", "200").inc()
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def generate(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        key: ApiKey | None,
        chat: bool,
        shaped: Callable[[str, OutputReading | None], ResponseShape] | None = None,
        kept: Callable[[ResponseShape], Awaitable[None]] | None = None,
        request_id: str | None = None,
    ) -> Response:
        """`body`'s answer, as the chat or completion endpoint's objects, or as `shaped`'s (given the request's
        id and its output's reading); `kept` is awaited with the shape once the whole answer is made."""
        path = endpoint(request.scope)
        request_id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        samplings = body.choice_samplings()
        model, lora = registry.resolve(body.model)  # (an adapter: the model it adapts, and it)
        reading: OutputReading | None = body.tool_calling
        if isinstance(body, ChatCompletionRequest) and (parsed := output_parsers.reading(body, model)) is not None:
            reading = parsed  # the model's parsers read its output, and may constrain its calls in their format
            samplings = [options.model_copy(update=parsed.sampling_update) for options in samplings]
        now = time.monotonic()
        arrival = request.scope.get("state", {}).get(RECEIVED_AT, now)  # its first byte read (__main__'s protocol)
        metrics.http_wait.observe(now - arrival)
        span = tracer.start_span(
            "router request",
            kind=trace.SpanKind.SERVER,
            context=telemetry.extract(request.headers),
            start_time=time.time_ns() - int((now - arrival) * 1e9),
            attributes={
                "request.id": request_id,
                "model": body.model,
                "stream": body.stream,
                "n": body.n,
                "endpoint": path,
                "api_key.name": key.name if key else "",
                "http.wait_s": now - arrival,
            },
        )
        parent = trace.set_span_in_context(span)
        deadline = time.time() - (now - arrival) + request_timeout_s
        served = registry.catalogue.get(model)  # its targets, where the request sets none
        inputs = body.inputs()
        # a generation a choice of each prompt (choice j of prompt i at index i·n + j, as vLLM orders them),
        # each a request of its own through the mesh
        choices = [
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
        shape = (
            shaped(request_id, reading)
            if shaped is not None
            else ResponseShape(
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
        )
        streams = [dispatcher.generate(choice, parent) for choice in choices]
        times = [metrics.request(model, arrival) for _ in choices]
        done = False

        def finish(status: int, exc: BaseException | None = None, finish_reasons: Sequence[str | None] = ()) -> None:
            nonlocal done
            if done:
                return
            done = True
            for choice_times, reason in itertools.zip_longest(times, finish_reasons):
                choice_times.ended(reason or ("abort" if status == 499 else "error"))
            metrics.requests.labels(path, str(status)).inc()
            span.set_attribute("http.status_code", status)
            if exc is not None:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, str(exc))
            span.end()

        async def close_streams() -> None:
            """A stream closed before its end aborts its request in the worker: shielded (Starlette cancels
            a stream whose client is gone at every await) and bounded."""
            with anyio.move_on_after(CLOSE_STREAMS_S, shield=True):
                for stream in streams:
                    await stream.aclose()

        def prompt_tokens(deltas: list[TokenDelta]) -> int:
            """Each prompt's tokens once (from its first choice's delta), as vLLM's usage counts them."""
            return sum(delta.prompt_tokens for delta in deltas[:: body.n])

        def cached_tokens(firsts: list[TokenDelta]) -> int:
            """Each prompt's tokens found cached, once (its choices' first deltas tell them)."""
            return sum(delta.cached_tokens or 0 for delta in firsts[:: body.n])

        try:
            # Wait for every choice's first token before answering, so that errors found by the workers
            # (context too long, no capacity) still get their proper HTTP status.
            firsts = await _unless_disconnected(request, _first_of_each(streams))
            if body.echoes:
                firsts = [
                    echoed(delta, prompt_alone=body.max_tokens == 0, with_text=not body.return_token_ids)
                    for delta in firsts
                ]
            lasts = [choice_times.seen(delta) for choice_times, delta in zip(times, firsts)]
            if not body.stream:
                rests = await _unless_disconnected(request, _rest_of_each(streams, times))
                answer = [Choice.of([first, *rest]) for first, rest in zip(firsts, rests)]
                whole = shape.final(answer, prompt_tokens(firsts), cached_tokens(firsts))
                if kept is not None:
                    await kept(shape)
                finish(200, finish_reasons=[c.finish_reason for c in answer])
                return JSONResponse(whole)
        except MeshError as exc:
            await close_streams()
            finish(exc.http_status, exc)
            metrics.errors.labels(exc.code).inc()
            return error_response(exc)
        except _ClientGone:
            await close_streams()  # the dispatcher aborts the request in the worker
            finish(499)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        except BaseException as exc:
            await close_streams()
            finish(499 if isinstance(exc, asyncio.CancelledError) else 500, exc)
            raise

        client_gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def events() -> AsyncGenerator[bytes, None]:
            try:
                for index, first in enumerate(firsts):
                    yield shape.chunk_event(
                        first.text,
                        first.finish_reason,
                        True,
                        first.token_ids,
                        first.logprobs,
                        index,
                        first.stop_reason,
                        first.prompt_token_ids,
                        (first.prompt_tokens, first.completion_tokens),
                        first.prompt_text,
                    )
                async with aclosing(merged(streams, SSE_KEEPALIVE_S, client_gone)) as rest:
                    async for batch in rest:
                        if batch is None:  # a silence (e.g. waiting for a worker): proxies and clients keep the stream
                            yield b": keep-alive\n\n"
                            continue
                        for index, delta in coalesced(batch):
                            lasts[index] = times[index].seen(delta)
                            yield shape.chunk_event(
                                delta.text,
                                delta.finish_reason,
                                token_ids=delta.token_ids,
                                logprobs=delta.logprobs,
                                index=index,
                                stop_reason=delta.stop_reason,
                                counts=(delta.prompt_tokens, delta.completion_tokens),
                            )
                completion_tokens = sum(last.completion_tokens for last in lasts)
                ending = shape.stream_end(prompt_tokens(lasts), completion_tokens, cached_tokens(firsts))
                if kept is not None:
                    await kept(shape)
                yield ending
                finish(200, finish_reasons=[last.finish_reason for last in lasts])
            except _ClientGone:
                pass  # (finally: its requests aborted)
            except MeshError as exc:  # mid-stream failure: an OpenAI error event, then the end
                metrics.errors.labels(exc.code).inc()
                finish(exc.http_status, exc)
                yield shape.stream_error(exc)
            except Exception as exc:  # a bug: the client still gets a typed end, not a cut stream
                log.exception("request %s failed mid-stream", request_id)
                internal = MeshError(f"internal error: {type(exc).__name__}")
                metrics.errors.labels(internal.code).inc()
                finish(internal.http_status, exc)
                yield shape.stream_error(internal)
            finally:
                await close_streams()  # client gone: the dispatcher aborts the requests in their workers
                finish(499)

        return _EventStream(events(), client_gone, headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})

    return app


class StampedProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, noting in each request's scope when its first byte was read, so that the
    router's spans, deadlines and TTFT count from there: a loop busy relaying tokens delays a new request's
    handler, and that wait is the router's (`llmesh_router_http_wait_seconds`); and the server's own `send`,
    which an event stream's chunks take past Starlette's middlewares (`_EventStream`)."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["state"][RECEIVED_AT] = time.monotonic()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # (not an upgrade)
            self.scope["state"][SERVER_SEND] = self.cycle.send


class _BodyLimit:
    """A request body over `limit` bytes is a 413, before it is read whole: at once where its Content-Length
    says so, else when the bytes streamed in pass the limit. The body is read here and handed on as it came
    (FastAPI would turn an error raised while it reads into a 400)."""

    def __init__(self, app: Any, limit: int, refused: Callable[[MeshError, Scope], JSONResponse]):
        self.app, self.limit, self.refused = app, limit, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), b"")
        counted = not declared.isdigit()  # (sent chunked: its bytes are counted as they come)
        size = 0 if counted else int(declared)
        messages: list[Message] = []
        while size <= self.limit:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left
            size += len(message.get("body", b"")) if counted else 0
            if not message.get("more_body"):
                break
        if size > self.limit:
            error = RequestTooLarge(f"the request body is over {self.limit:,} bytes, the most the router takes")
            await self.refused(error, scope)(scope, receive, send)
            return

        pending = iter(messages)

        async def replayed() -> Message:
            return next(pending, None) or await receive()

        await self.app(scope, replayed, send)


class _EventStream(Response):
    """A server-sent event stream: its body's chunks sent as they come, the client's leaving told to the body
    at once (`client_gone`: Starlette's `StreamingResponse` only cancels the task iterating a body whose client
    is gone, which lands where it waits, and one with tokens always ready may never wait), the body closed
    however it ends. One task listens for the disconnect; `StreamingResponse` runs two in a task group a
    response under uvicorn (ASGI 2.3), which cost a third of the HTTP layer's time a chunk (measured)."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncGenerator[bytes, None], client_gone: asyncio.Future[None], headers: dict[str, str]
    ):
        self.body_iterator, self.client_gone = content, client_gone
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        listening = asyncio.ensure_future(self._listen(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            # the middlewares' wrappers of `send` only need to see that the response began: the chunks go to the
            # server's own (a few µs a chunk less)
            send = scope.get("state", {}).get(SERVER_SEND, send)
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            listening.cancel()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.client_gone.done():
            self.client_gone.set_result(None)


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


async def _rest_of_each(
    streams: Sequence[AsyncIterator[TokenDelta]], times: list[RequestTimes]
) -> list[list[TokenDelta]]:
    rests: list[list[TokenDelta]] = [[] for _ in streams]
    async with aclosing(merged(streams, None)) as batches:
        async for batch in batches:
            for index, delta in batch or ():
                rests[index].append(times[index].seen(delta))
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
