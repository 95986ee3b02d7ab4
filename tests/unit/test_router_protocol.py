"""The router's HTTP protocol notes when a request's first byte was read (its spans, deadline and TTFT count
from there, not from when a busy event loop got to its handler) and the server's own `send`."""

import asyncio
import socket
import time

import uvicorn

from llmesh.deploy.launcher import free_port
from llmesh_router.asgi import RECEIVED_AT, SERVER_SEND, StampedProtocol


def test_a_request_is_stamped_at_its_first_byte():
    seen: list[float] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append(time.monotonic() - scope["state"][RECEIVED_AT])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await scope["state"][SERVER_SEND]({"type": "http.response.body", "body": b""})

    async def main():
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, port=port, http=StampedProtocol, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(b"GET / HTTP/1.1\r\n")  # the first bytes; the rest of the head a while later
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"Host: x\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 204")
        writer.close()
        server.should_exit = True
        await serving

    asyncio.run(main())
    assert len(seen) == 1 and seen[0] >= 0.3
