"""NATS handlers of one kv-store shard: put (possibly split in segments), get (streamed), stats."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llmesh.bus import FRAME_OVERHEAD, Bus
from llmesh.errors import BadMessage
from llmesh.messages import Ack, KvFlush, KvGet, KvGetPart, KvPut, KvStats, KvStatsRequest, Subjects

from .store import ChunkStore

log = logging.getLogger(__name__)


@dataclass
class _Assembly:
    request: KvPut
    buffer: bytearray
    started: float = field(default_factory=time.monotonic)
    received: int = 0


class KvStoreService:
    def __init__(self, bus: Bus, store: ChunkStore, shard: str, assembly_timeout_s: float = 30.0):
        self.bus, self.store, self.shard = bus, store, shard
        self._assembly_timeout_s = assembly_timeout_s
        self._assemblies: dict[str, _Assembly] = {}
        self._bytes_put = self._bytes_got = 0

    async def start(self) -> None:
        await self.bus.serve(Subjects.kv(self.shard, "put"), self.put, span="kv-store put")
        await self.bus.serve(Subjects.kv(self.shard, "get"), self.get, span="kv-store get")
        await self.bus.serve(Subjects.kv(self.shard, "stats"), self.stats, traced=False)
        await self.bus.serve(Subjects.kv(self.shard, "flush"), self.flush, span="kv-store flush")

    async def put(self, msg: KvPut, blob: memoryview) -> Ack:
        if not isinstance(msg, KvPut):
            raise BadMessage(f"expected KvPut, got {type(msg).__name__}")
        if len(msg.keys) != len(msg.sizes) or any(s < 0 for s in msg.sizes) or sum(msg.sizes) != msg.total_size:
            raise BadMessage("KvPut keys, sizes and total_size disagree")
        if msg.offset < 0 or msg.offset + len(blob) > msg.total_size:
            raise BadMessage(f"segment [{msg.offset}, {msg.offset + len(blob)}) lies outside {msg.total_size} bytes")
        self._bytes_put += len(blob)
        if len(blob) == msg.total_size:  # the common case: one segment
            self._store(msg, blob)
            return Ack()
        self._drop_stale_assemblies()
        if msg.total_size > self.store.capacity_bytes:
            raise BadMessage(f"a put of {msg.total_size} bytes exceeds the store's capacity")
        asm = self._assemblies.get(msg.transfer_id)
        if asm is None:
            asm = self._assemblies[msg.transfer_id] = _Assembly(msg, bytearray(msg.total_size))
        elif asm.request.keys != msg.keys or asm.request.total_size != msg.total_size:
            raise BadMessage(f"segments of transfer {msg.transfer_id} disagree")
        asm.buffer[msg.offset : msg.offset + len(blob)] = blob
        asm.received += len(blob)
        if asm.received >= msg.total_size:
            del self._assemblies[msg.transfer_id]
            self._store(msg, memoryview(asm.buffer))
        return Ack()

    def _store(self, msg: KvPut, blob: memoryview) -> None:
        items, pos = [], 0
        for key, size in zip(msg.keys, msg.sizes):
            items.append((key, bytes(blob[pos : pos + size])))
            pos += size
        self.store.put_many(items, msg.pin_s)

    def _drop_stale_assemblies(self) -> None:
        cutoff = time.monotonic() - self._assembly_timeout_s
        for tid in [t for t, a in self._assemblies.items() if a.started < cutoff]:
            log.warning("dropping incomplete put %s after %.0fs", tid, self._assembly_timeout_s)
            del self._assemblies[tid]

    async def get(self, msg: KvGet, blob: memoryview) -> AsyncIterator[tuple[KvGetPart, memoryview]]:
        if not isinstance(msg, KvGet):
            raise BadMessage(f"expected KvGet, got {type(msg).__name__}")
        values = [self.store.get(key, msg.pin_s) for key in msg.keys]
        sizes = [-1 if v is None else len(v) for v in values]
        payload = memoryview(b"".join(v for v in values if v is not None))
        self._bytes_got += len(payload)
        segment = max(self.bus.max_payload - FRAME_OVERHEAD, 4096)
        for offset in range(0, max(len(payload), 1), segment):
            yield KvGetPart(sizes=sizes, offset=offset, total_size=len(payload)), payload[offset : offset + segment]

    def snapshot(self) -> KvStats:
        return self.store.stats().model_copy(update={"bytes_put": self._bytes_put, "bytes_got": self._bytes_got})

    async def stats(self, msg: KvStatsRequest, blob: memoryview) -> KvStats:
        return self.snapshot()

    async def flush(self, msg: KvFlush, blob: memoryview) -> KvStats:
        self.store.flush_to_ssd()
        return self.snapshot()
