"""NATS helpers, so that services contain no bus boilerplate.

- `Bus.connect`: connects with retry and unlimited reconnects.
- `Bus.request`: request/reply with a deadline; typed errors come back raised.
- `Bus.stream`: a request answered by a stream of messages. All of a client's streams share
  one subscription, and a server sends the replies it produces for one client within one turn
  of its event loop as one NATS message (`StreamBatch`): a decode worker's engine step reaches
  each router as one message, whatever the number of requests in it.
- `Bus.serve`: handles a subject (optionally in a queue group); a handler returns a reply,
  an async iterator of replies (a stream), or None (events). Each message gets its own
  task and a span parented on the caller's trace context from the headers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry import trace

from llmesh.wire import telemetry
from llmesh.wire.errors import BadMessage, MeshError, NoResponders, RequestTooLarge, ServiceUnavailable, Timeout
from llmesh.wire.lifecycle import Channel
from llmesh.wire.messages import (
    ErrorReply,
    Message,
    StreamBatch,
    StreamEnd,
    decode,
    decode_any,
    encode,
    split_batch,
)
from llmesh.wire.secrets import inbox_prefix, nats_tls, redacted, url_user

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

Reply = Message | tuple[Message, bytes | bytearray | memoryview]
Handler = Callable[[M, memoryview], Awaitable[Reply | None] | AsyncIterator[Reply]]  # M: the message it handles

# Room left in a payload for the frame header and NATS headers.
FRAME_OVERHEAD = 64 * 1024
STREAM_HEADER = "Mesh-Stream"  # on a `Bus.stream` request: replies may go batched to `<reply's parent>.batch`
_BATCH = "batch"
_NO_RESPONDERS = object()


def _is_no_responders(msg: Msg) -> bool:
    return not msg.data and msg.headers is not None and msg.headers.get("Status") == "503"


class _StreamMux:
    """Every reply stream of one client on one subscription to `<prefix>.>`: a stream's replies
    come to `<prefix>.<stream id>` (NATS's no-responders notice too) or, several streams'
    together, to `<prefix>.batch`."""

    def __init__(self, bus: Bus):
        self.prefix = f"{bus.nc.new_inbox()}.s"
        self._streams: dict[str, ReplyStream] = {}
        self._next = 0
        self._bus = bus

    async def start(self) -> None:
        await self._bus.nc.subscribe(f"{self.prefix}.>", cb=self._on_msg)

    def open(self, stream: ReplyStream) -> str:
        self._next += 1
        stream_id = f"{self._next:x}"
        self._streams[stream_id] = stream
        return stream_id

    def close(self, stream_id: str) -> None:
        self._streams.pop(stream_id, None)

    async def _on_msg(self, msg: Msg) -> None:
        token = msg.subject[len(self.prefix) + 1 :]
        if token != _BATCH:
            stream = self._streams.get(token)
            if stream is not None:
                stream.feed(_NO_RESPONDERS if _is_no_responders(msg) else msg.data)
            return
        try:
            for stream_id, frame in split_batch(msg.data):
                stream = self._streams.get(stream_id)
                if stream is not None:
                    stream.feed(frame)
        except MeshError as exc:
            log.warning("undecodable reply batch on %s: %s", msg.subject, exc.message)


class _Outbox:
    """Replies to one client's streams, sent as one `StreamBatch` per turn of the event loop. Each batch
    names `gone_subject` as its reply subject, where NATS answers "no responders" once the client's
    subscription is gone (its process died): the handlers producing its streams are then cancelled,
    which frees what they hold (a worker's engine slot) at once instead of at their end."""

    def __init__(self, bus: Bus, subject: str, gone_subject: str):
        self._bus, self._subject, self._gone_subject = bus, subject, gone_subject
        self._ids: list[str] = []
        self._frames: list[bytes] = []
        self._sending: asyncio.Task | None = None
        self.producers: set[asyncio.Task] = set()  # the handlers streaming to this client

    def add(self, stream_id: str, frame: bytes) -> None:
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush)
        self._ids.append(stream_id)
        self._frames.append(frame)

    def _flush(self) -> None:
        batch = encode(StreamBatch(streams=self._ids, sizes=[len(f) for f in self._frames]), b"".join(self._frames))
        self._ids, self._frames = [], []
        self._sending = self._bus._spawn(self._send(batch, self._sending))  # in order, after the previous one

    async def _send(self, batch: bytes, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait({previous})
        try:
            await self._bus.nc.publish(self._subject, batch, reply=self._gone_subject)
        except nats.errors.Error as exc:
            log.warning("could not send replies on %s: %s", self._subject, exc)

    def produced_by(self, task: asyncio.Task) -> None:
        if task not in self.producers:
            self.producers.add(task)
            task.add_done_callback(self.producers.discard)


class ReplyStream:
    """The replies to one `Bus.stream` call; iterate it, or hand them to a function as they come (`each`); then it
    closes itself."""

    def __init__(self, bus: Bus, subject: str, deadline: float):
        self._bus, self._subject, self._deadline = bus, subject, deadline
        self._queue: Channel[bytes | memoryview | object | BaseException] = Channel()
        self._stream_id: str | None = None
        self._done = False
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._on_reply: Callable[[Message], bool] | None = None  # where replies go as they come (`each`)
        self._ended: asyncio.Future[None] | None = None  # and the end `each` awaits

    async def _open(self, msg: Message, blob: bytes) -> None:
        frame = self._bus.framed(msg, blob)
        mux = await self._bus._stream_mux()
        self._stream_id = mux.open(self)
        # One timer for the whole stream (not one per reply): it ends the stream at the deadline.
        self._deadline_timer = asyncio.get_running_loop().call_later(
            max(self._deadline - time.time(), 0), self.fail, Timeout(f"deadline passed waiting for {self._subject}")
        )
        headers = telemetry.inject()
        headers[STREAM_HEADER] = "1"
        await self._bus.nc.publish(self._subject, frame, reply=f"{mux.prefix}.{self._stream_id}", headers=headers)

    def feed(self, item: bytes | memoryview | object) -> None:
        if self._on_reply is not None:
            self._deliver(item)
        else:
            self._queue.put(item)

    def fail(self, exc: BaseException) -> None:
        """End the stream with `exc` (e.g. the producing worker was declared dead)."""
        self.feed(exc)

    async def each(self, on_reply: Callable[[Message], bool]) -> None:
        """Hand every reply to `on_reply` as it comes, called from the bus's own read of it (no task and no queue
        between them: a stream's replies are a router's hottest path), until the stream ends or `on_reply`
        returns False (it has had its last); an error ending the stream, or raised by `on_reply`, is raised here.
        The stream is closed when this returns or raises (its blobs are not kept: a reply's are not handed on)."""
        assert self._on_reply is None, "one reader a stream"
        self._ended = asyncio.get_running_loop().create_future()
        self._on_reply = on_reply
        try:
            for item in self._queue.take_all():  # (come before the reader)
                self._deliver(item)
            await self._ended
        finally:
            self._on_reply = None
            await self.close()

    def _deliver(self, item: bytes | memoryview | object) -> None:
        ended = self._ended
        assert ended is not None and self._on_reply is not None
        if ended.done():
            return  # (replies after the end the reader chose, or after an error)
        try:
            decoded = self._decoded(item)
            if decoded is None or not self._on_reply(decoded[0]):
                ended.set_result(None)
        except BaseException as exc:  # (the stream's error, or the reader's: raised where `each` waits)
            ended.set_exception(exc)

    def _decoded(self, item: bytes | memoryview | object) -> tuple[Message, memoryview] | None:
        """A fed item's reply, None at the stream's end; the stream's error raised."""
        if isinstance(item, BaseException):
            raise item
        if item is _NO_RESPONDERS:
            raise NoResponders(f"nothing is serving {self._subject}")
        assert isinstance(item, (bytes, memoryview))
        reply, blob = decode_any(item)
        return None if isinstance(reply, StreamEnd) else (reply, blob)

    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> tuple[Message, memoryview]:
        if self._done:
            raise StopAsyncIteration
        try:
            decoded = self._decoded(await self._queue.get())
        except BaseException:
            await self.close()
            raise
        if decoded is None:
            await self.close()
            raise StopAsyncIteration
        return decoded

    async def close(self) -> None:
        if not self._done:
            self._done = True
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            if self._stream_id is not None and self._bus._mux is not None:
                self._bus._mux.close(self._stream_id)


class Bus:
    def __init__(self, nc: Client, name: str):
        self.nc = nc
        self.name = name
        self._tasks: set[asyncio.Task] = set()
        self._tracer = telemetry.tracer(f"llmesh.{name}")
        self._mux: _StreamMux | None = None
        self._mux_started: asyncio.Task | None = None
        self._outboxes: dict[str, _Outbox] = {}  # a stream client's reply prefix -> its outbox
        self._gone_subject: str | None = None  # where NATS says a stream client is gone (subscribed on first use)
        # called after a reconnection: NATS delivers at most once, so what was in flight may be lost
        self.reconnected: list[Callable[[], None]] = []

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _stream_mux(self) -> _StreamMux:
        """The client side of every stream, subscribed on first use (once, however many wait)."""
        if self._mux is None:
            self._mux = _StreamMux(self)
            self._mux_started = asyncio.ensure_future(self._mux.start())
        assert self._mux_started is not None
        await asyncio.shield(self._mux_started)
        return self._mux

    @classmethod
    async def connect(cls, url: str, name: str, *, connect_timeout: float = 30.0) -> Bus:
        """Connect within `connect_timeout` (nats-py retries meanwhile); afterwards reconnect forever. A `url`
        that names a CA (`llmesh.wire.secrets.trusting_nats_ca`) goes over TLS from its first byte, trusting
        that CA alone."""

        nc = nats.NATS()

        async def on_error(exc: Exception) -> None:
            log.warning("nats error (%s): %s", name, exc)

        async def on_disconnect() -> None:
            if not nc.is_closed:  # not our own close
                log.warning("nats disconnected (%s)", name)

        connected: list[Bus] = []

        async def on_reconnect() -> None:
            log.info("nats reconnected (%s)", name)
            for callback in list(connected[0].reconnected) if connected else []:
                callback()

        user = url_user(url)
        try:
            servers, tls = nats_tls(url)
            # With unlimited reconnects nats-py retries the first connection forever too: bound it.
            await asyncio.wait_for(
                nc.connect(
                    servers=servers,
                    tls=tls,
                    tls_handshake_first=tls
                    is not None,  # never a byte in the clear (llmesh.deploy.credentials.nats_tls_block)
                    name=name,
                    inbox_prefix=inbox_prefix(user) if user else "_INBOX",  # where this user may read replies
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,  # type: ignore[arg-type]  # annotated int, but slept on as seconds
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                ),
                connect_timeout,
            )
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            raise ServiceUnavailable(
                f"cannot reach NATS at {redacted(url)} within {connect_timeout:.0f}s: {exc!r}"
            ) from exc
        connected.append(cls(nc, name))
        return connected[0]

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def synced(self) -> None:
        """Return once the server has processed every command sent so far. nats-py 2.16's `flush()`
        writes its PING straight to the socket, ahead of commands still in its pending buffer (such
        as the SUB just made), so one round trip can end before the server has the SUB (in tests a
        request right after `serve` got "no responders" about one run in three). The first round
        trip lets nats-py's flusher write what was pending; the second PING follows it."""
        await self.nc.flush()
        await self.nc.flush()

    async def close(self) -> None:
        """Cancel in-flight handlers, send what is buffered, close. (No drain: the handlers are
        already cancelled, and nats-py's drain races its own flush futures on shutdown.)"""
        for task in list(self._tasks):
            task.cancel()
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            try:
                await self.nc.flush(timeout=1)
            except (nats.errors.Error, TimeoutError):
                pass
            except asyncio.CancelledError:
                # nats-py cancels its pending flush when the server goes away meanwhile; only a
                # cancellation of this task itself propagates.
                current = asyncio.current_task()
                assert current is not None
                if current.cancelling():
                    raise
        await self.nc.close()

    # ---- client side ----------------------------------------------------------------

    def framed(self, msg: Message, blob: bytes = b"") -> bytes:
        """`msg` encoded, or RequestTooLarge where it would not fit in a NATS message (nats-py's own
        error would be an internal one)."""
        frame = encode(msg, blob)
        if len(frame) > self.nc.max_payload:
            raise RequestTooLarge(
                f"the request takes {len(frame):,} bytes in a message to a worker; at most {self.nc.max_payload:,} fit"
            )
        return frame

    async def publish(self, subject: str, msg: Message, blob: bytes = b"") -> None:
        await self.nc.publish(subject, self.framed(msg, blob), headers=telemetry.inject())

    async def request(
        self, subject: str, msg: Message, expected: type[M], *, timeout: float, blob: bytes = b""
    ) -> tuple[M, memoryview]:
        if timeout <= 0:
            raise Timeout(f"no time left to ask {subject}")
        try:
            reply = await self.nc.request(subject, self.framed(msg, blob), timeout=timeout, headers=telemetry.inject())
        except nats.errors.NoRespondersError:
            raise NoResponders(f"nothing is serving {subject}") from None
        except nats.errors.TimeoutError:
            raise Timeout(f"{subject} did not answer within {timeout:.1f}s") from None
        return decode(reply.data, expected)

    async def stream(self, subject: str, msg: Message, *, deadline: float, blob: bytes = b"") -> ReplyStream:
        """Send `msg` and return the stream of its replies (ends at the producer's StreamEnd)."""
        replies = ReplyStream(self, subject, deadline)
        await replies._open(msg, blob)
        return replies

    # ---- server side ------------------------------------------------------------------

    async def serve(
        self, subject: str, handler: Handler[M], *, queue: str = "", span: str | None = None, traced: bool = True
    ) -> None:
        """Handle `subject` (in queue group `queue`, if given: one member gets each message);
        each message runs in its own task (strongly referenced).

        `traced=False` skips the span (for periodic chatter such as heartbeats).
        """

        async def on_msg(msg: Msg) -> None:
            self._spawn(self._handle(msg, handler, span or subject, traced))

        await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        await self.synced()  # the server knows the subscription once we return

    async def _handle(self, msg: Msg, handler: Handler[Any], span_name: str, traced: bool) -> None:
        parent = telemetry.extract(msg.headers)
        span_cm = (
            self._tracer.start_as_current_span(span_name, context=parent, kind=trace.SpanKind.SERVER)
            if traced
            else trace.use_span(trace.INVALID_SPAN)
        )
        with span_cm as span:
            try:
                request, blob = decode_any(msg.data)
                result = handler(request, blob)
                if isinstance(result, AsyncIterator):
                    async for item in result:
                        await self._reply(msg, item)
                    await self._reply(msg, StreamEnd())
                else:
                    reply = await result
                    if reply is not None:
                        await self._reply(msg, reply)
            except asyncio.CancelledError:
                raise
            except MeshError as exc:
                if not isinstance(exc, BadMessage):
                    log.info("%s: %s: %s", span_name, exc.code, exc.message)
                else:
                    log.warning("%s: rejected message: %s", span_name, exc.message)
                span.set_attribute("error.code", exc.code)
                await self._reply(msg, ErrorReply.of(exc))
            except Exception as exc:
                log.exception("%s: handler failed", span_name)
                span.record_exception(exc)
                await self._reply(msg, ErrorReply(code="internal_error", message=f"{type(exc).__name__}: {exc}"))

    async def _gone_inbox(self) -> str:
        if self._gone_subject is None:
            subject = f"{self.nc.new_inbox()}.gone"
            await self.nc.subscribe(subject, cb=self._on_client_gone)
            self._gone_subject = subject
        return self._gone_subject

    async def _on_client_gone(self, msg: Msg) -> None:
        """NATS found no subscriber for a batch of stream replies: that client is gone; stop producing."""
        if not _is_no_responders(msg):
            return
        assert msg.headers is not None  # a no-responders notice has them
        batch_subject = msg.headers.get("Nats-Subject", "")
        outbox = self._outboxes.pop(batch_subject.removesuffix(f".{_BATCH}"), None)
        if outbox is None:
            return
        if outbox.producers:
            log.warning("the client reading %s is gone: stopping its %d streams", batch_subject, len(outbox.producers))
        for task in list(outbox.producers):
            task.cancel()

    async def _reply(self, request: Msg, reply: Reply) -> None:
        if not request.reply:
            return
        msg, blob = reply if isinstance(reply, tuple) else (reply, b"")
        if request.headers and STREAM_HEADER in request.headers:  # batched with the client's other streams
            parent, stream_id = request.reply.rsplit(".", 1)
            outbox = self._outboxes.get(parent)
            if outbox is None:
                outbox = self._outboxes[parent] = _Outbox(self, f"{parent}.{_BATCH}", await self._gone_inbox())
            task = asyncio.current_task()
            if task is not None:
                outbox.produced_by(task)
            outbox.add(stream_id, encode(msg, blob))
            return
        try:
            await self.nc.publish(request.reply, encode(msg, blob))
        except nats.errors.Error as exc:
            log.warning("could not answer on %s: %s", request.reply, exc)
