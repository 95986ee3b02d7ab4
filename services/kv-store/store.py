"""The shard's chunk store: a memory tier over an optional SSD tier.

Memory evicts its least recently used unpinned chunks; with an SSD tier they are demoted
there instead of dropped, and an SSD hit is promoted back to memory (the SSD copy stays:
chunks are immutable, so the next demotion of that key costs no write). Pins are leases
on the memory tier: they expire, so a crashed worker cannot pin memory forever.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from llmesh.errors import KVStoreFull
from llmesh.messages import KvStats

from .ssd import SsdTier


@dataclass
class _Chunk:
    data: bytes
    pinned_until: float


class ChunkStore:
    def __init__(self, capacity_bytes: int, ssd: SsdTier | None = None, clock: Callable[[], float] = time.monotonic):
        self.capacity_bytes = capacity_bytes
        self.ssd = ssd
        self._clock = clock
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # oldest first
        self._bytes = 0
        self.memory_hits = self.ssd_hits = self.misses = self.evictions = self.puts = 0
        self.demotions = self.promotions = 0

    def __contains__(self, key: str) -> bool:
        """Held in any tier (not counted as a hit)."""
        return key in self._chunks or (self.ssd is not None and key in self.ssd)

    def keys(self) -> list[str]:
        """Every key held, memory tier first."""
        ssd_only = [k for k in self.ssd.keys() if k not in self._chunks] if self.ssd is not None else []
        return [*self._chunks, *ssd_only]

    def put_many(self, items: list[tuple[str, bytes]], pin_s: float) -> None:
        """Store all items or none: room is made for the whole batch first."""
        needed = sum(len(data) for key, data in items if key not in self._chunks)
        self._make_room(needed)
        pinned_until = self._clock() + pin_s
        for key, data in items:
            self._insert(key, data, pinned_until)
            self.puts += 1

    def get(self, key: str, pin_s: float = 0.0) -> bytes | None:
        chunk = self._chunks.get(key)
        if chunk is not None:
            self.memory_hits += 1
            self._chunks.move_to_end(key)
            if pin_s:
                chunk.pinned_until = max(chunk.pinned_until, self._clock() + pin_s)
            return chunk.data
        data = self.ssd.read(key) if self.ssd is not None else None
        if data is None:
            self.misses += 1
            return None
        self.ssd_hits += 1
        try:
            self._make_room(len(data))
            self._insert(key, data, self._clock() + pin_s)
            self.promotions += 1
        except KVStoreFull:
            pass  # memory is all pinned: serve from SSD without promoting
        return data

    def _insert(self, key: str, data: bytes, pinned_until: float) -> None:
        old = self._chunks.pop(key, None)
        if old is not None:
            self._bytes -= len(old.data)
            pinned_until = max(pinned_until, old.pinned_until)
        self._chunks[key] = _Chunk(data, pinned_until)
        self._bytes += len(data)

    def _make_room(self, needed: int) -> None:
        if needed > self.capacity_bytes:
            raise KVStoreFull(f"{needed} bytes exceed the store's capacity of {self.capacity_bytes}")
        if self._bytes + needed <= self.capacity_bytes:
            return
        now = self._clock()
        for key in [k for k, c in self._chunks.items() if c.pinned_until <= now]:
            if self._bytes + needed <= self.capacity_bytes:
                return
            data = self._chunks.pop(key).data
            self._bytes -= len(data)
            if self.ssd is not None and (key in self.ssd or self.ssd.write(key, data)):
                self.demotions += 1
            else:
                self.evictions += 1
        if self._bytes + needed > self.capacity_bytes:
            raise KVStoreFull(f"need {needed} bytes but everything left is pinned ({self._bytes} bytes held)")

    def flush_to_ssd(self) -> None:
        """Move every chunk, pinned or not, to the SSD tier (see KvFlush)."""
        if self.ssd is None:
            return
        for key in list(self._chunks):
            data = self._chunks[key].data
            if key in self.ssd or self.ssd.write(key, data):
                del self._chunks[key]
                self._bytes -= len(data)
                self.demotions += 1

    def stats(self) -> KvStats:
        now = self._clock()
        ssd = self.ssd
        has_ssd = ssd is not None  # (an empty SsdTier is falsy: it has a length)
        return KvStats(
            chunks=len(self._chunks),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            pinned_bytes=sum(len(c.data) for c in self._chunks.values() if c.pinned_until > now),
            hits=self.memory_hits + self.ssd_hits,
            misses=self.misses,
            evictions=self.evictions,
            puts=self.puts,
            memory_hits=self.memory_hits,
            ssd_hits=self.ssd_hits,
            demotions=self.demotions,
            promotions=self.promotions,
            ssd_enabled=has_ssd and ssd.enabled,
            ssd_chunks=len(ssd) if has_ssd else 0,
            ssd_bytes=ssd.bytes if has_ssd else 0,
            ssd_capacity_bytes=ssd.capacity_bytes if has_ssd else 0,
            ssd_corrupt=ssd.corrupt if has_ssd else 0,
        )
