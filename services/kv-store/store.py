"""The shard's chunk store: a memory tier (a pre-faulted arena) over an optional SSD tier.

Memory evicts its least recently used chunks; with an SSD tier they are demoted there
instead of dropped, and an SSD hit is promoted back to memory (the SSD copy stays: chunks
are immutable, so the next demotion of that key costs no write). Two things keep a chunk in
memory: a pin, which is a lease that expires (so a crashed worker cannot pin memory
forever), and readers, held by a transfer in flight between `get_many` and `release`.

With an SSD tier, a cleaner (ShardState) copies least recently used chunks to SSD in the
background once memory passes a watermark, so eviction under pressure usually drops a chunk
that is already on SSD instead of writing it on the put path.

Writes are two-phase so a transfer can land straight in the arena: `reserve` returns
writable views, `commit` makes them visible (or `abort` frees them). Chunks are content
addressed, so a put of a key already held keeps the held copy and only extends its lease.
The store is not thread-safe; the shard serialises calls (see ShardState).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llmesh.wire.errors import BadMessage, KVStoreFull
from llmesh.wire.kvwire import footprint
from llmesh.wire.messages import KvStats

from .arena import Arena
from .ssd import SsdTier

ARENA_SLACK = 1 / 16  # headroom over `capacity_bytes` for alignment and fragmentation
EVICTION_SCAN = 64  # evictable chunks an eviction looks through for one already on SSD
CLEAN_SCAN = 256  # chunks a cleaning pass looks through under the shard's lock


@dataclass
class _Chunk:
    offset: int
    size: int
    pinned_until: float
    readers: int = 0
    reads: int = 0  # gets it answered from memory (the SSD tier admits, by default, only chunks read)


@dataclass
class Reservation:
    keys: list[str]
    chunks: list[_Chunk]
    views: list[memoryview]


@dataclass
class Slab:
    """Arena space granted to one client connection, which lays values out in it from the
    front (`cursor`) and has them adopted as chunks (`adopt`)."""

    offset: int
    end: int
    cursor: int


@dataclass
class Read:
    """Values of a `get_many`, in key order (None: missing); valid until `ChunkStore.release`."""

    values: list[memoryview | None]
    held: list[_Chunk] = field(default_factory=list)


class ChunkStore:
    def __init__(
        self,
        capacity_bytes: int,
        ssd: SsdTier | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared_arena: bool = False,
    ):
        self.capacity_bytes = capacity_bytes
        self.ssd = ssd
        self.arena = Arena(int(capacity_bytes * (1 + ARENA_SLACK)), shared=shared_arena)
        self._clock = clock
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # least recently used first
        self._bytes = 0
        self.on_drop: Callable[[str], None] | None = None  # a key left every tier
        self.cleaned_in_background = False  # a cleaner copies chunks to SSD (ShardState.start_cleaner)
        self.memory_hits = self.ssd_hits = self.misses = self.evictions = self.puts = 0
        self.demotions = self.promotions = 0

    def __contains__(self, key: str) -> bool:
        """Held in any tier (not counted as a hit)."""
        return key in self._chunks or (self.ssd is not None and key in self.ssd)

    def keys(self) -> list[str]:
        """Every key held, memory tier first."""
        ssd_only = [k for k in self.ssd.keys() if k not in self._chunks] if self.ssd is not None else []
        return [*self._chunks, *ssd_only]

    def size_of(self, key: str) -> int | None:
        chunk = self._chunks.get(key)
        if chunk is not None:
            return chunk.size
        return self.ssd.size_of(key) if self.ssd is not None else None

    # ---- writes ------------------------------------------------------------------------------

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], pin_s: float) -> Reservation:
        """Room for all the values or none (KVStoreFull); nothing is visible until `commit`."""
        pinned_until = self._clock() + pin_s
        res = Reservation(list(keys), [], [])
        try:
            for size in sizes:
                chunk = _Chunk(self._alloc(size), size, pinned_until)
                self._bytes += size
                res.chunks.append(chunk)
                res.views.append(self.arena.view[chunk.offset : chunk.offset + size])
        except KVStoreFull:
            self.abort(res)
            raise
        return res

    def commit(self, res: Reservation) -> None:
        for key, chunk in zip(res.keys, res.chunks):
            self.puts += 1
            held = self._chunks.get(key)
            if held is not None:  # same key, same content: keep ours, extend the lease
                held.pinned_until = max(held.pinned_until, chunk.pinned_until)
                self._chunks.move_to_end(key)
                self._free(chunk)
            else:
                self._chunks[key] = chunk

    def abort(self, res: Reservation) -> None:
        for chunk in res.chunks:
            self._free(chunk)
        res.chunks.clear()

    def grant(self, size: int, least: int | None = None) -> Slab:
        """`size` bytes of arena for a client's puts in place if they are free; else `least` (default:
        `size`), evicting for them. Evicting for a slab larger than the client needs would empty a
        fragmented arena of chunks (each written to SSD, under the store's lock) to make it contiguous."""
        size = footprint(size)
        offset = self.arena.alloc(size) if self._bytes + size <= self.capacity_bytes else None
        if offset is None:
            size = footprint(least if least is not None else size)
            offset = self._alloc(size)
        self._bytes += size
        return Slab(offset, offset + size, offset)

    def adopt(
        self, slab: Slab, keys: Sequence[str], sizes: Sequence[int], offsets: Sequence[int], pin_s: float
    ) -> None:
        """Make values a client wrote into its slab, in order from the cursor, chunks."""
        pos = slab.cursor
        for size, offset in zip(sizes, offsets):
            if offset != pos or pos + footprint(size) > slab.end:
                raise BadMessage(f"values must follow each other from offset {pos} within the granted space")
            pos += footprint(size)
        pinned_until = self._clock() + pin_s
        res = Reservation(list(keys), [], [])
        for size, offset in zip(sizes, offsets):
            res.chunks.append(_Chunk(offset, size, pinned_until))
            self._bytes -= footprint(size) - size  # granted space becomes the chunk's
        slab.cursor = pos
        self.commit(res)

    def release_slab(self, slab: Slab) -> None:
        if slab.end > slab.cursor:
            self.arena.free(slab.cursor, slab.end - slab.cursor)
            self._bytes -= slab.end - slab.cursor
        slab.cursor = slab.end

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]], pin_s: float) -> None:
        res = self.reserve([k for k, _ in items], [len(v) for _, v in items], pin_s)
        for view, (_, value) in zip(res.views, items):
            view[:] = value
        self.commit(res)

    # ---- reads -------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str], pin_s: float = 0.0) -> Read:
        """Values (views into memory, or SSD bytes not promoted); held until `release`."""
        read = Read([])
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self.memory_hits += 1
                chunk.reads += 1
                self._chunks.move_to_end(key)
            else:
                chunk = self._promote(key, pin_s, read)
                if chunk is None:
                    continue
            if pin_s:
                chunk.pinned_until = max(chunk.pinned_until, self._clock() + pin_s)
            chunk.readers += 1
            read.held.append(chunk)
            read.values.append(self.arena.view[chunk.offset : chunk.offset + chunk.size])
        return read

    def release(self, read: Read) -> None:
        for chunk in read.held:
            chunk.readers -= 1
        read.held.clear()

    def get(self, key: str, pin_s: float = 0.0) -> bytes | None:
        """A copy of one value (None: missing)."""
        read = self.get_many([key], pin_s)
        try:
            value = read.values[0]
            return None if value is None else bytes(value)
        finally:
            self.release(read)

    def _promote(self, key: str, pin_s: float, read: Read) -> _Chunk | None:
        data = self.ssd.read(key) if self.ssd is not None else None
        if data is None:
            self.misses += 1
            read.values.append(None)
            return None
        self.ssd_hits += 1
        try:
            res = self.reserve([key], [len(data)], pin_s)
        except KVStoreFull:  # memory is all pinned or in flight: serve from SSD without promoting
            read.values.append(memoryview(data))
            return None
        res.views[0][:] = data
        self.commit(res)
        self.promotions += 1
        return self._chunks[key]

    # ---- room ----------------------------------------------------------------------------------

    def _alloc(self, size: int) -> int:
        if size > self.capacity_bytes:
            raise KVStoreFull(f"{size} bytes exceed the store's capacity of {self.capacity_bytes}")
        while True:
            if self._bytes + size <= self.capacity_bytes:
                offset = self.arena.alloc(size)
                if offset is not None:
                    return offset
            if not self._evict_one():
                raise KVStoreFull(
                    f"need {size} bytes but everything left is pinned or in flight ({self._bytes} bytes held)"
                )

    def _evict_one(self) -> bool:
        """Evict the least recently used chunk not pinned or in flight. With a background cleaner
        (`cleaned_in_background`), the put path never waits on a disk write: it takes the first such
        chunk the cleaner has copied to SSD among the next `EVICTION_SCAN`, else drops the least recently
        used one (puts faster than the disk writes: a cache misses later rather than stall the writer)."""
        now = self._clock()
        first = None
        for scanned, (key, chunk) in enumerate(self._chunks.items()):
            if chunk.pinned_until > now or chunk.readers:
                continue
            if not self.cleaned_in_background or self.ssd is None or key in self.ssd:
                self._move_out(key)
                return True
            if first is None:
                first = key
            if scanned >= EVICTION_SCAN:
                break
        if first is None:
            return False
        self._move_out(first, write=False)
        return True

    def _move_out(self, key: str, write: bool = True) -> None:
        """Demote `key` to SSD (written now if `write` and it has no copy there yet), or drop it for good
        if there is no SSD tier, it refused, or `write` is False and it has no copy there."""
        chunk = self._chunks[key]
        data = self.arena.view[chunk.offset : chunk.offset + chunk.size]
        on_ssd = self.ssd is not None and (key in self.ssd or (write and self.ssd.write(key, data)))
        del self._chunks[key]
        self._free(chunk)
        if on_ssd:
            self.demotions += 1
        else:
            self.evictions += 1
            if self.on_drop is not None:
                self.on_drop(key)

    def _free(self, chunk: _Chunk) -> None:
        self.arena.free(chunk.offset, chunk.size)
        self._bytes -= chunk.size

    # ---- cleaning: copies on SSD ahead of eviction --------------------------------------------

    def dirty_to_clean(self, limit_bytes: int, unread_too: bool = False) -> list[tuple[str, _Chunk, memoryview]]:
        """Least recently used chunks with no SSD copy while memory is over `limit_bytes`, held
        as readers so they stay put while `clean` writes them outside the shard's lock. Unless
        `unread_too`, only chunks read at least once: one never read (a request's KV written behind
        in case of a failover, a prompt no other has shared yet) is dropped when evicted, so that the
        disk's bandwidth goes to KV that is reused (writing every chunk took the disk and the cores from
        the engines: docs/benchmarks.md, several models, the kv-store's share)."""
        if self.ssd is None or not self.ssd.enabled or self._bytes <= limit_bytes:
            return []
        batch: list[tuple[str, _Chunk, memoryview]] = []
        size = 0
        for scanned, (key, chunk) in enumerate(self._chunks.items()):
            if size >= self._bytes - limit_bytes or len(batch) >= 64 or scanned >= CLEAN_SCAN:
                break
            if key in self.ssd or not (unread_too or chunk.reads):  # clean, or to be dropped: counts toward the excess
                size += chunk.size
            elif chunk.readers == 0:
                chunk.readers += 1
                batch.append((key, chunk, self.arena.view[chunk.offset : chunk.offset + chunk.size]))
                size += chunk.size
        return batch

    def clean(self, batch: list[tuple[str, _Chunk, memoryview]]) -> int:
        """Write a `dirty_to_clean` batch to SSD (no shard lock needed); the chunks stay in memory,
        and their eviction later costs no write. Returns how many were written."""
        assert self.ssd is not None
        return sum(1 for key, _, data in batch if self.ssd.write(key, data))

    def done_cleaning(self, batch: list[tuple[str, _Chunk, memoryview]]) -> None:
        for _, chunk, _ in batch:
            chunk.readers -= 1

    def flush_to_ssd(self) -> None:
        """Move every chunk not in flight, pinned or not, to the SSD tier (see KvFlush)."""
        for key in self.in_memory():
            self.demote(key)

    def in_memory(self) -> list[str]:
        return list(self._chunks) if self.ssd is not None else []

    def demote(self, key: str) -> None:
        """Move `key` to the SSD tier, unless it is gone or in flight."""
        chunk = self._chunks.get(key)
        if chunk is None or chunk.readers or self.ssd is None:
            return
        if key in self.ssd or self.ssd.write(key, self.arena.view[chunk.offset : chunk.offset + chunk.size]):
            del self._chunks[key]
            self._free(chunk)
            self.demotions += 1

    def stats(self) -> KvStats:
        now = self._clock()
        ssd = self.ssd  # (compared with None: an empty SsdTier is falsy, it has a length)
        return KvStats(
            chunks=len(self._chunks),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            pinned_bytes=sum(c.size for c in self._chunks.values() if c.pinned_until > now),
            hits=self.memory_hits + self.ssd_hits,
            misses=self.misses,
            evictions=self.evictions,
            puts=self.puts,
            memory_hits=self.memory_hits,
            ssd_hits=self.ssd_hits,
            demotions=self.demotions,
            promotions=self.promotions,
            ssd_enabled=ssd is not None and ssd.enabled,
            ssd_chunks=len(ssd) if ssd is not None else 0,
            ssd_bytes=ssd.bytes if ssd is not None else 0,
            ssd_capacity_bytes=ssd.capacity_bytes if ssd is not None else 0,
            ssd_corrupt=ssd.corrupt if ssd is not None else 0,
        )
