"""The router's HTTP API: OpenAI-compatible endpoints plus /health and /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmesh.wire import telemetry
from llmesh.wire.errors import InvalidRequest, MeshError
from llmesh.wire.lifecycle import cancel_and_wait
from llmesh.wire.messages import ROLES, TokenDelta

from .auth import ApiKey, KeyRing
from .dispatch import Dispatcher, Generation
from .metrics import RequestTimes, RouterMetrics
from .openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    error_body,
    error_response,
    sse,
    validation_error,
)
from .registry import WorkerRegistry

log = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.2
SSE_KEEPALIVE_S = 15.0  # a stream silent this long gets an SSE comment (proxies cut idle streams at 60 s)


def _seconds(ms: float | None) -> float | None:
    return ms / 1000 if ms else None


def create_app(
    dispatcher: Dispatcher,
    registry: WorkerRegistry,
    metrics: RouterMetrics,
    request_timeout_s: float,
    keys: KeyRing | None = None,
) -> FastAPI:
    """The router's app; with `keys`, every /v1 endpoint needs one of them (/health and /metrics,
    for probes and scrapers, do not: bind them to a private address, as vLLM's server does)."""
    app = FastAPI(title="llmesh router", version="0.1.0")
    tracer = telemetry.tracer("llmesh.router")
    keyring = keys or KeyRing(())

    async def api_key(request: Request) -> ApiKey | None:  # async: FastAPI runs a plain def in its thread pool
        return keyring.admit(request.headers.get("authorization"))

    def counted_error(exc: MeshError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(exc.http_status)).inc()
        metrics.errors.labels(exc.code).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return counted_error(validation_error(list(exc.errors())), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = InvalidRequest(str(exc.detail))
        err.http_status = exc.status_code
        return counted_error(err, request.url.path)

    @app.exception_handler(MeshError)
    async def on_mesh_error(request: Request, exc: MeshError) -> JSONResponse:
        return counted_error(exc, request.url.path)

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
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "llmesh"} for m in registry.models()],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, key: ApiKey | None = Depends(api_key)) -> Response:
        return await generate(request, body, key, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, key: ApiKey | None = Depends(api_key)
    ) -> Response:
        return await generate(request, body, key, chat=True)

    async def generate(
        request: Request, body: CompletionRequest | ChatCompletionRequest, key: ApiKey | None, chat: bool
    ) -> Response:
        endpoint = request.url.path
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        span = tracer.start_span(
            "router request",
            kind=trace.SpanKind.SERVER,
            context=telemetry.extract(request.headers),
            attributes={
                "request.id": request_id,
                "model": body.model,
                "stream": body.stream,
                "endpoint": endpoint,
                "api_key.name": key.name if key else "",
            },
        )
        parent = trace.set_span_in_context(span)
        served = registry.catalogue.get(body.model)  # its targets, where the request sets none
        gen = Generation(
            request_id=request_id,
            model=body.model,
            prompt=None if chat else body.prompt_text,  # type: ignore[union-attr]
            prompt_token_ids=None if chat else body.prompt_token_ids,  # type: ignore[union-attr]
            messages=[m.to_message() for m in body.messages] if chat else None,  # type: ignore[union-attr]
            sampling=body.sampling(),
            deadline=time.time() + request_timeout_s,
            cache_salt=body.cache_salt,
            priority=body.priority,
            ttft_slo_s=_seconds(body.ttft_slo_ms or (served.ttft_slo_ms if served else None)),
            tpot_slo_s=_seconds(body.tpot_slo_ms or (served.tpot_slo_ms if served else None)),
        )
        shape = ResponseShape(chat, request_id, body.model, gen.sampling.logprobs)
        deltas = dispatcher.generate(gen, parent)
        times = metrics.request(body.model)
        done = False

        def finish(status: int, exc: BaseException | None = None, finished_reason: str | None = None) -> None:
            nonlocal done
            if done:
                return
            done = True
            times.ended(finished_reason or ("abort" if status == 499 else "error"))
            metrics.requests.labels(endpoint, str(status)).inc()
            span.set_attribute("http.status_code", status)
            if exc is not None:
                span.record_exception(exc)
                span.set_status(trace.StatusCode.ERROR, str(exc))
            span.end()

        try:
            # Wait for the first token before answering, so that errors found by the workers
            # (context too long, no capacity) still get their proper HTTP status.
            first = times.seen(await _unless_disconnected(request, anext(deltas)))
            if not body.stream:
                parts = [first]
                if first.finish_reason is None:
                    parts += await _unless_disconnected(request, _collect(deltas, times))
                last = parts[-1]
                finish(200, finished_reason=last.finish_reason)
                token_ids = [t for p in parts for t in p.token_ids] if body.return_token_ids else None
                return JSONResponse(
                    shape.final(
                        "".join(p.text for p in parts),
                        last.finish_reason,
                        last.prompt_tokens,
                        last.completion_tokens,
                        token_ids,
                        [step for p in parts for step in p.logprobs or ()],
                    )
                )
        except MeshError as exc:
            await deltas.aclose()
            finish(exc.http_status, exc)
            metrics.errors.labels(exc.code).inc()
            return error_response(exc)
        except _ClientGone:
            await deltas.aclose()  # the dispatcher aborts the request in the worker
            finish(499)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        except BaseException as exc:
            await deltas.aclose()
            finish(499 if isinstance(exc, asyncio.CancelledError) else 500, exc)
            raise

        async def events() -> AsyncIterator[bytes]:
            last = first
            try:
                ids = body.return_token_ids
                yield shape.chunk_event(
                    first.text, first.finish_reason, True, first.token_ids if ids else None, first.logprobs
                )
                async for delta in with_keepalive(deltas, SSE_KEEPALIVE_S):
                    if delta is None:  # a silence (e.g. waiting for a worker): proxies and clients keep the stream
                        yield b": keep-alive\n\n"
                        continue
                    last = times.seen(delta)
                    yield shape.chunk_event(
                        delta.text,
                        delta.finish_reason,
                        token_ids=delta.token_ids if ids else None,
                        logprobs=delta.logprobs,
                    )
                if body.include_usage:
                    yield sse(shape.usage_chunk(last.prompt_tokens, last.completion_tokens))
                yield sse("[DONE]")
                finish(200, finished_reason=last.finish_reason)
            except MeshError as exc:  # mid-stream failure: an OpenAI error event, then the end
                metrics.errors.labels(exc.code).inc()
                finish(exc.http_status, exc)
                yield sse(error_body(exc))
            except Exception as exc:  # a bug: the client still gets a typed end, not a cut stream
                log.exception("request %s failed mid-stream", request_id)
                internal = MeshError(f"internal error: {type(exc).__name__}")
                metrics.errors.labels(internal.code).inc()
                finish(internal.http_status, exc)
                yield sse(error_body(internal))
            finally:
                await deltas.aclose()  # client gone: the dispatcher aborts the request in the worker
                finish(499)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": request_id}
        )

    return app


async def _collect(deltas: AsyncIterator[TokenDelta], times: RequestTimes) -> list[TokenDelta]:
    return [times.seen(d) async for d in deltas]


async def with_keepalive(items: AsyncIterator[T], every_s: float) -> AsyncIterator[T | None]:
    """`items`, and None after each `every_s` without one. One task pulls `items` into a queue and one
    timer a period watches for silence: nothing is created per item (a stream's tokens are the router's
    hottest path)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[T | None | _Ended] = asyncio.Queue()
    last_at = loop.time()
    timer: asyncio.TimerHandle  # the silence watch's next check

    async def pull() -> None:
        try:
            async for item in items:
                queue.put_nowait(item)
            queue.put_nowait(_Ended(None))
        except BaseException as exc:  # (cancelled: by the consumer's end, or by a bug that must not hang it)
            queue.put_nowait(_Ended(exc))
            raise

    def watch() -> None:
        nonlocal timer
        silent_s = loop.time() - last_at
        if silent_s >= every_s and queue.empty():
            queue.put_nowait(None)
            silent_s = 0.0
        timer = loop.call_later(every_s - silent_s, watch)

    puller = asyncio.create_task(pull())
    timer = loop.call_later(every_s, watch)
    try:
        while not isinstance(item := await queue.get(), _Ended):
            last_at = loop.time()
            yield item
        if item.error is not None:
            raise item.error
    finally:
        timer.cancel()
        await cancel_and_wait(puller)


@dataclass(frozen=True, slots=True)
class _Ended:
    """The end of `with_keepalive`'s items, or the error that ended them."""

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
