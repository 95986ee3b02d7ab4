"""The ASGI pieces around the router's routes: the server's protocol that stamps a request's arrival, the body
limit, the request count, and the event stream a streamed answer is."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable
from typing import Any, get_type_hints

import anyio
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import Counter
from pydantic import BaseModel
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmesh.wire.errors import MeshError, RequestTooLarge

RECEIVED_AT = "llmesh.received_at"  # a request scope's state: when its first byte was read (monotonic s)
SERVER_SEND = "llmesh.server_send"  # and the server's `send`, unwrapped by the middlewares (StampedProtocol)
_ANSWERED = "llmesh.answered"  # and the status its count takes, where its answer told it (`answered`)


class StampedProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, noting in each request's scope when its first byte was read, so that the
    router's spans, deadlines and TTFT count from there: a loop busy relaying tokens delays a new request's
    handler, and that wait is the router's (`llmesh_router_http_wait_seconds`); and the server's own `send`,
    which an event stream's chunks take past Starlette's middlewares (`EventStream`)."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["state"][RECEIVED_AT] = time.monotonic()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # (not an upgrade)
            self.scope["state"][SERVER_SEND] = self.cycle.send


class BodyRoute(APIRoute):
    """A route whose endpoint takes a JSON body (a pydantic model), the request and at most one dependency of the
    request alone (the API key), and answers a Response, called without FastAPI's generic dependency solving (with
    it, its route took a tenth of a 1-token request's router CPU, profiled): the body parsed, the key taken and the
    body validated as FastAPI does, in its order (`json.loads`, the dependency, the model's validator). A body that
    is not JSON or fails validation is handed to FastAPI's own handler, so its error stays FastAPI's, word for word."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        generic = super().get_route_handler()
        (body,) = self.dependant.body_params
        model = body.field_info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), f"{self.path}: its body is not a model"
        keys = [(dep.name, dep.call) for dep in self.dependant.dependencies]
        request_name, call = self.dependant.request_param_name, self.dependant.call
        assert call is not None and request_name, f"{self.path}: its endpoint does not take the request"
        assert issubclass(get_type_hints(call)["return"], Response), (
            f"{self.path}: its endpoint's answer is no Response"
        )
        assert all(
            inspect.iscoroutinefunction(key) and len(inspect.signature(key).parameters) == 1 for _, key in keys
        ), f"{self.path}: a dependency that is not an async function of the request alone"

        async def handler(request: Request) -> Response:
            # in FastAPI's order: the body read as JSON (a strict content type), the dependency, the validation
            if not request.headers.get("content-type", "").startswith("application/json"):
                return await generic(request)
            try:
                document = json.loads(await request.body())
            except ValueError:
                return await generic(request)
            args: dict[str, Any] = {request_name: request}
            for name, key in keys:
                value = await key(request)  # type: ignore[misc]  # (checked above)
                if name:
                    args[name] = value
            try:
                args[body.name] = model.model_validate(document)
            except ValueError:  # (pydantic's ValidationError)
                return await generic(request)
            response: Response = await call(**args)
            return response

        return handler


def endpoint(scope: Scope, routes: Iterable[BaseRoute] = ()) -> str:
    """What a request's metrics count it under: its route's path (one label however many ids its paths hold), or
    "unmatched" (a label per unknown path would grow without bound); `routes` match one not routed yet (refused
    by the body limit)."""
    route = scope.get("route") or next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)
    return route.path if isinstance(route, Route) else "unmatched"


def answered(scope: Scope, status: int) -> None:
    """The status that request's count takes, where its response's own does not tell it: a stream's (200 as it
    began), known at its end."""
    scope.setdefault("state", {})[_ANSWERED] = status


class CountedRequests:
    """Counts each request once, when its answer has ended (`llmesh_requests_total`, by `endpoint` and status):
    its response's status, or the one `answered` gave it; 500 for an exception before any (499: cancelled). The
    paths in `uncounted` (probes', scrapers') are not counted."""

    def __init__(self, app: ASGIApp, requests: Counter, routes: Iterable[BaseRoute], uncounted: Collection[str]):
        self.app, self.requests, self.routes, self.uncounted = app, requests, routes, uncounted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        status: int | None = None

        async def seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, seen)
        except asyncio.CancelledError:
            status = status or 499
            raise
        except Exception:
            status = status or 500
            raise
        finally:
            path = endpoint(scope, self.routes)
            if path not in self.uncounted:
                self.requests.labels(path, str(state.get(_ANSWERED, status))).inc()


class BodyLimit:
    """A request body over `limit` bytes is a 413, before it is read whole: at once where its Content-Length
    says so, else when the bytes streamed in pass the limit. The body is read here and handed on as it came
    (FastAPI would turn an error raised while it reads into a 400)."""

    def __init__(self, app: ASGIApp, limit: int, refused: Callable[[MeshError], Response]):
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
            await self.refused(error)(scope, receive, send)
            return

        pending = iter(messages)

        async def replayed() -> Message:
            return next(pending, None) or await receive()

        await self.app(scope, replayed, send)


class EventStream(Response):
    """A server-sent event stream, written by `content(send)` with the server's own `send` (past the middlewares'
    wrappers, which only need to see that the response began: a few µs a chunk less), the client's leaving told
    at once (`client_gone`: Starlette's `StreamingResponse` only cancels the task writing a body whose client is
    gone, which lands where it waits, and one with tokens always ready may never wait), `close` awaited however
    it ends. One task listens for the disconnect; `StreamingResponse` runs two in a task group a response under
    uvicorn (ASGI 2.3), which cost a third of the HTTP layer's time a chunk (measured)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: Callable[[Send], Awaitable[None]],
        close: Callable[[], Awaitable[None]],
        client_gone: asyncio.Future[None],
        headers: dict[str, str],
    ):
        self.content, self.close, self.client_gone = content, close, client_gone
        self.status_code, self.background = 200, None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        listening = asyncio.ensure_future(self._listen(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await self.content(scope.get("state", {}).get(SERVER_SEND, send))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            listening.cancel()
            with anyio.CancelScope(shield=True):
                await self.close()

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.client_gone.done():
            self.client_gone.set_result(None)


def sent_now(send: Send, message: Message) -> Awaitable[None] | None:
    """`send(message)` run to its end at once where it does not wait, as uvicorn's write to a socket with room
    does not (no task wakes for it, nor does the caller need to be one); else what is left of it, to await (a
    client slow to read: the server's flow control waits for its socket to drain)."""
    sending = send(message)
    if not isinstance(sending, Coroutine):
        return sending
    try:
        waiting = sending.send(None)
    except StopIteration:
        return None
    return _sent_rest(sending, waiting)


async def _sent_rest(sending: Coroutine[Any, Any, None], waiting: asyncio.Future[Any] | None) -> None:
    """`sending` driven on from where it first waited (on `waiting`, the future it yielded), as a task would."""
    while True:
        try:
            if waiting is None:  # (a bare yield: asyncio.sleep(0))
                await asyncio.sleep(0)
            else:
                await asyncio.wait({waiting})  # (its result or error is `sending`'s to read)
        except BaseException as exc:  # (cancelled: so is the send, where it waits)
            if waiting is not None:
                waiting.cancel()
            try:
                waiting = sending.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waiting = sending.send(None)
        except StopIteration:
            return
