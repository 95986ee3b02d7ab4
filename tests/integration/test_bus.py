"""Bus helpers on a real nats-server: queue groups, deadlines; OTLP export from a real process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from llmesh.wire.bus import Bus
from llmesh.wire.errors import RequestTooLarge, Timeout
from llmesh.wire.messages import Ack, KvStatsRequest, LengthPredictRequest

pytestmark = pytest.mark.timeout(30)


async def test_queue_group_members_share_the_load_and_each_message_is_handled_once(nats_url):
    handled: dict[str, int] = {"a": 0, "b": 0}
    buses = [await Bus.connect(nats_url, name) for name in ("a", "b", "client")]

    def handler(name):
        async def handle(msg, blob):
            handled[name] += 1
            await asyncio.sleep(0.01)
            return Ack()

        return handle

    try:
        for bus in buses[:2]:
            await bus.serve("test.queue", handler(bus.name), queue="replicas")
        await asyncio.gather(*(buses[2].request("test.queue", KvStatsRequest(), Ack, timeout=5) for _ in range(40)))
        assert handled["a"] + handled["b"] == 40 and handled["a"] > 0 and handled["b"] > 0
    finally:
        for bus in buses:
            await bus.close()


async def test_request_deadline_is_a_typed_timeout(nats_url):
    server, client = await Bus.connect(nats_url, "slow"), await Bus.connect(nats_url, "impatient")

    async def slow(msg, blob):
        await asyncio.sleep(5)
        return Ack()

    try:
        await server.serve("test.slow", slow)
        with pytest.raises(Timeout):
            await client.request("test.slow", KvStatsRequest(), Ack, timeout=0.3)
        with pytest.raises(asyncio.TimeoutError):  # Timeout is also an asyncio.TimeoutError
            await client.request("test.slow", KvStatsRequest(), Ack, timeout=0.3)
    finally:
        await client.close()
        await server.close()


async def test_a_message_larger_than_natss_max_payload_is_a_typed_413_and_leaves_no_stream_open(nats_url):
    server, client = await Bus.connect(nats_url, "server"), await Bus.connect(nats_url, "client")

    async def answer(msg, blob):
        return Ack()

    try:
        await server.serve("test.big", answer)
        big = LengthPredictRequest(request_id="r", prompt="a" * client.max_payload)
        with pytest.raises(RequestTooLarge, match="at most") as refused:
            await client.request("test.big", big, Ack, timeout=5)
        assert refused.value.http_status == 413
        with pytest.raises(RequestTooLarge):
            await client.stream("test.big", big, deadline=time.time() + 5)
        with pytest.raises(RequestTooLarge):
            await client.publish("test.big", big)
        assert client._mux is None or not client._mux._streams  # (the stream was refused before it opened)
        small = LengthPredictRequest(request_id="r", prompt="a" * 100)
        assert isinstance((await client.request("test.big", small, Ack, timeout=5))[0], Ack)
    finally:
        await client.close()
        await server.close()


def test_spans_are_exported_over_otlp_when_an_endpoint_is_configured():
    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        script = (
            "from llmesh.wire import telemetry; from opentelemetry import trace;"
            f"telemetry.setup_tracing('probe', otlp_endpoint='http://127.0.0.1:{server.server_port}',"
            " trace_dir=None);"
            "trace.get_tracer('t').start_span('exported-span').end();"
            "trace.get_tracer_provider().force_flush()"
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=20)
    finally:
        server.shutdown()
    assert [path for path, _ in received] == ["/v1/traces"]
    assert b"exported-span" in received[0][1] and b"probe" in received[0][1]


async def test_connecting_to_a_dead_server_fails_within_its_timeout():
    from llmesh.deploy.launcher import free_port
    from llmesh.wire.errors import ServiceUnavailable

    started = asyncio.get_running_loop().time()
    with pytest.raises(ServiceUnavailable, match="cannot reach NATS"):
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", "hopeless", connect_timeout=1.5)
    assert asyncio.get_running_loop().time() - started < 3


async def test_streams_of_one_client_share_one_message_per_turn_and_each_gets_its_own_replies(nats_url):
    from llmesh.wire.errors import InvalidRequest, ServiceUnavailable
    from llmesh.wire.messages import TokenDelta

    server, client = await Bus.connect(nats_url, "streamer"), await Bus.connect(nats_url, "reader")
    steps = asyncio.Event()

    async def generate(msg, blob):
        for step in range(5):  # all streams advance on the same event, as an engine step wakes every request
            await steps.wait()
            yield TokenDelta(text=f"{msg.prompt}:{step}", token_ids=[step])
        if msg.prompt == "s7":
            raise InvalidRequest("stream 7 fails after its tokens")

    try:
        await server.serve("test.stream", generate)
        streams = [
            await client.stream("test.stream", LengthPredictRequest(prompt=f"s{i}"), deadline=time.time() + 10)
            for i in range(20)
        ]
        sent_before = server.nc.stats["out_msgs"]

        async def read(i, stream):
            texts = []
            try:
                async for delta, _ in stream:
                    texts.append(delta.text)
            except InvalidRequest:
                texts.append("failed")
            return texts

        readers = asyncio.gather(*(read(i, s) for i, s in enumerate(streams)))
        for _ in range(5):
            await asyncio.sleep(0.05)
            steps.set()
            steps.clear()
        results = await readers
        for i, texts in enumerate(results):
            assert texts == [f"s{i}:{step}" for step in range(5)] + (["failed"] if i == 7 else [])
        sent = server.nc.stats["out_msgs"] - sent_before
        assert sent <= 10, f"{sent} messages for 20 streams x 6 replies: not batched"
        with pytest.raises(ServiceUnavailable):  # nothing serves it: NATS's notice reaches the stream
            async for _ in await client.stream("test.nobody", Ack(), deadline=time.time() + 5):
                pass
    finally:
        await client.close()
        await server.close()


async def test_a_stream_ends_with_a_typed_timeout_at_its_deadline_after_the_replies_that_came(nats_url):
    from llmesh.wire.messages import TokenDelta

    server, client = await Bus.connect(nats_url, "stalls"), await Bus.connect(nats_url, "waits")

    async def one_then_stall(msg, blob):
        yield TokenDelta(text="first", token_ids=[1])
        await asyncio.sleep(5)
        yield TokenDelta(text="late", token_ids=[2])

    try:
        await server.serve("test.stall", one_then_stall)
        received = []
        started = time.monotonic()
        with pytest.raises(Timeout):
            async for delta, _ in await client.stream("test.stall", Ack(), deadline=time.time() + 0.5):
                received.append(delta.text)
        assert received == ["first"] and 0.4 < time.monotonic() - started < 2
    finally:
        await client.close()
        await server.close()


async def test_streams_to_a_client_that_died_stop_at_once_and_others_go_on(nats_url):
    """A client's process dies (its connection closes) mid-stream: NATS finds nobody subscribed to its
    replies, and the server cancels the handlers producing them (a worker frees their engine slots),
    while another client's stream on the same server goes on."""
    from llmesh.wire.messages import TokenDelta

    server = await Bus.connect(nats_url, "producer")
    doomed, survivor = await Bus.connect(nats_url, "doomed"), await Bus.connect(nats_url, "survivor")
    stopped: dict[str, float] = {}

    async def endless(msg, blob):
        try:
            for i in range(1_000_000):
                yield TokenDelta(text=str(i), token_ids=[i], completion_tokens=i + 1)
                await asyncio.sleep(0.01)
        finally:
            stopped[msg.prompt] = time.monotonic()

    try:
        await server.serve("test.endless", endless)
        streams = {
            name: await bus.stream(
                "test.endless", LengthPredictRequest(request_id=name, prompt=name), deadline=time.time() + 20
            )
            for name, bus in (("doomed", doomed), ("survivor", survivor))
        }
        for replies in streams.values():
            await anext(replies)
        await doomed.nc.close()  # as the process's death closes its socket
        closed = time.monotonic()
        while "doomed" not in stopped:
            assert time.monotonic() - closed < 2, "the dead client's stream still runs"
            await asyncio.sleep(0.01)
        assert "survivor" not in stopped
        seen = [(await anext(streams["survivor"]))[0].token_ids[0] for _ in range(20)]
        assert seen == sorted(seen) and len(set(seen)) == 20
    finally:
        for bus in (server, survivor):
            await bus.close()
