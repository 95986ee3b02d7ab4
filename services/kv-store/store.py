"""The memory tier: chunks by key, least-recently-used eviction that skips pinned chunks."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmesh.errors import KVStoreFull
from llmesh.messages import KvStats


@dataclass
class _Chunk:
    data: bytes
    pinned_until: float


class ChunkStore:
    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # oldest first
        self._bytes = 0
        self.hits = self.misses = self.evictions = self.puts = 0

    def put_many(self, items: list[tuple[str, bytes]], pin_s: float) -> None:
        """Store all items or none: room is made for the whole batch first."""
        needed = sum(len(data) for key, data in items if key not in self._chunks)
        self._make_room(needed)
        pinned_until = self._clock() + pin_s
        for key, data in items:
            old = self._chunks.pop(key, None)
            if old is not None:
                self._bytes -= len(old.data)
                pinned_until = max(pinned_until, old.pinned_until)
            self._chunks[key] = _Chunk(data, pinned_until)
            self._bytes += len(data)
            self.puts += 1

    def get(self, key: str, pin_s: float = 0.0) -> bytes | None:
        chunk = self._chunks.get(key)
        if chunk is None:
            self.misses += 1
            return None
        self.hits += 1
        self._chunks.move_to_end(key)
        if pin_s:
            chunk.pinned_until = max(chunk.pinned_until, self._clock() + pin_s)
        return chunk.data

    def _make_room(self, needed: int) -> None:
        if needed > self.capacity_bytes:
            raise KVStoreFull(f"{needed} bytes exceed the store's capacity of {self.capacity_bytes}")
        if self._bytes + needed <= self.capacity_bytes:
            return
        now = self._clock()
        for key in [k for k, c in self._chunks.items() if c.pinned_until <= now]:
            if self._bytes + needed <= self.capacity_bytes:
                return
            self._bytes -= len(self._chunks.pop(key).data)
            self.evictions += 1
        if self._bytes + needed > self.capacity_bytes:
            raise KVStoreFull(f"need {needed} bytes but everything left is pinned ({self._bytes} bytes held)")

    def stats(self) -> KvStats:
        now = self._clock()
        return KvStats(
            chunks=len(self._chunks),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            pinned_bytes=sum(len(c.data) for c in self._chunks.values() if c.pinned_until > now),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            puts=self.puts,
        )
