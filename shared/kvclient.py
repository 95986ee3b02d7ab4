"""Client of the kv-store: put and get chunks, splitting transfers bigger than a NATS payload.

`KvClient` is async (for services); `ThreadedKvClient` runs one on a private event-loop
thread for synchronous callers such as the vLLM connector, returning futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Sequence

from llmesh.bus import FRAME_OVERHEAD, Bus
from llmesh.errors import BadMessage
from llmesh.messages import Ack, KvGet, KvGetPart, KvPut, Subjects

Buffer = bytes | bytearray | memoryview


class KvClient:
    def __init__(self, bus: Bus, shard: str = "0"):
        self.bus = bus
        self._put_subject = Subjects.kv(shard, "put")
        self._get_subject = Subjects.kv(shard, "get")

    @property
    def segment_size(self) -> int:
        return max(self.bus.max_payload - FRAME_OVERHEAD, 4096)

    async def put(self, keys: Sequence[str], values: Sequence[Buffer], *, pin_s: float = 0.0,
                  timeout: float = 30.0) -> None:
        sizes = [len(memoryview(v).cast("B")) for v in values]
        blob = memoryview(b"".join(values))  # segments below are views of it, not copies
        transfer_id = uuid.uuid4().hex
        seg = self.segment_size
        requests = [
            self.bus.request(
                self._put_subject,
                KvPut(transfer_id=transfer_id, keys=list(keys), sizes=sizes, offset=off,
                      total_size=len(blob), pin_s=pin_s),
                Ack,
                timeout=timeout,
                blob=blob[off : off + seg],
            )
            for off in range(0, max(len(blob), 1), seg)
        ]
        await asyncio.gather(*requests)

    async def get(self, keys: Sequence[str], *, pin_s: float = 0.0, timeout: float = 30.0) -> list[memoryview | None]:
        """Values in key order; None for a key the store does not hold."""
        buf: bytearray | None = None
        sizes: list[int] = []
        received = 0
        replies = await self.bus.stream(self._get_subject, KvGet(keys=list(keys), pin_s=pin_s),
                                        deadline=time.time() + timeout)
        async for part, blob in replies:
            if not isinstance(part, KvGetPart) or part.offset + len(blob) > part.total_size:
                raise BadMessage("kv-store answered a get with a malformed part")
            if buf is None:
                buf, sizes = bytearray(part.total_size), part.sizes
            buf[part.offset : part.offset + len(blob)] = blob
            received += len(blob)
        if buf is None or received != len(buf) or len(sizes) != len(keys):
            raise BadMessage(f"kv-store answer incomplete: {received} of {len(buf or b'')} bytes")
        view, out, pos = memoryview(buf), [], 0
        for size in sizes:
            out.append(None if size < 0 else view[pos : pos + size])
            pos += max(size, 0)
        return out


class ThreadedKvClient:
    """A KvClient on its own event loop thread, for synchronous code (the vLLM connector)."""

    def __init__(self, nats_url: str, name: str, shard: str = "0"):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-kv", daemon=True)
        self._thread.start()
        bus = self._run(Bus.connect(nats_url, name)).result()
        self.client = KvClient(bus, shard)

    def _run(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def put(self, keys: Sequence[str], values: Sequence[Buffer], *, pin_s: float, timeout: float = 30.0,
            trace_context=None) -> concurrent.futures.Future:
        return self._run(self._with_context(self.client.put(keys, values, pin_s=pin_s, timeout=timeout), trace_context))

    def get(self, keys: Sequence[str], *, timeout: float = 30.0, trace_context=None) -> concurrent.futures.Future:
        return self._run(self._with_context(self.client.get(keys, timeout=timeout), trace_context))

    @staticmethod
    async def _with_context(coro, ctx):
        """Run `coro` with an OpenTelemetry context attached, so the kv-store spans join its trace."""
        if ctx is None:
            return await coro
        from opentelemetry import context

        token = context.attach(ctx)
        try:
            return await coro
        finally:
            context.detach(token)

    def close(self) -> None:
        self._run(self.client.bus.close()).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
