"""What the shard's NATS handlers and data-plane threads share: the store, its lock, counters.

Every store call runs under `lock`; the bytes themselves move outside it, between a
`reserve`/`commit` pair (puts) or a `get_many`/`release` pair (gets), which keep the
chunks involved out of eviction's way meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from llmesh.wire.messages import KvStats

from .store import ChunkStore, Read, Reservation, Slab


class ShardState:
    def __init__(self, store: ChunkStore):
        self.store = store
        self.lock = threading.Lock()
        self._stopping = threading.Event()
        self.bytes_put = self.bytes_got = 0
        self.on_put: Callable[[list[tuple[str, int]]], None] | None = None  # (key, size) stored
        self.on_access: Callable[[list[str]], None] | None = None  # keys read

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], pin_s: float) -> Reservation:
        with self.lock:
            self.bytes_put += sum(sizes)  # counted as received even if refused
            return self.store.reserve(keys, sizes, pin_s)

    def commit(self, res: Reservation) -> None:
        with self.lock:
            self.store.commit(res)
        if self.on_put is not None:
            self.on_put([(k, c.size) for k, c in zip(res.keys, res.chunks)])

    def abort(self, res: Reservation) -> None:
        with self.lock:
            self.store.abort(res)

    def grant(self, size: int, least: int | None = None) -> Slab:
        with self.lock:
            return self.store.grant(size, least)

    def adopt(
        self, slab: Slab, keys: Sequence[str], sizes: Sequence[int], offsets: Sequence[int], pin_s: float
    ) -> None:
        with self.lock:
            self.bytes_put += sum(sizes)
            self.store.adopt(slab, keys, sizes, offsets, pin_s)
        if self.on_put is not None:
            self.on_put(list(zip(keys, sizes)))

    def release_slab(self, slab: Slab) -> None:
        with self.lock:
            self.store.release_slab(slab)

    def get_many(self, keys: Sequence[str], pin_s: float) -> Read:
        with self.lock:
            read = self.store.get_many(keys, pin_s)
            self.bytes_got += sum(len(v) for v in read.values if v is not None)
        if self.on_access is not None:
            self.on_access([k for k, v in zip(keys, read.values) if v is not None])
        return read

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self.lock:
            return [k in self.store for k in keys]

    def release(self, read: Read) -> None:
        with self.lock:
            self.store.release(read)

    def start_cleaner(self, watermark: float, unread_too: bool = False, interval_s: float = 0.05) -> threading.Thread:
        """Copy least recently used chunks (read at least once, unless `unread_too`) to SSD while memory
        is over `watermark` of capacity."""
        self.store.cleaned_in_background = True  # so evictions drop what it has not copied yet, never write

        def run() -> None:
            while not self._stopping.wait(interval_s):
                self.clean_once(watermark, unread_too)

        thread = threading.Thread(target=run, name="kv-ssd-cleaner", daemon=True)
        thread.start()
        return thread

    def clean_once(self, watermark: float, unread_too: bool = False) -> int:
        with self.lock:
            batch = self.store.dirty_to_clean(int(self.store.capacity_bytes * watermark), unread_too)
        if not batch:
            return 0
        try:
            return self.store.clean(batch)
        finally:
            with self.lock:
                self.store.done_cleaning(batch)

    def stop(self) -> None:
        self._stopping.set()

    def flush_to_ssd(self) -> None:
        """A chunk at a time, so that puts and gets go on meanwhile (a full store takes seconds)."""
        with self.lock:
            keys = self.store.in_memory()
        for key in keys:
            with self.lock:
                self.store.demote(key)

    def snapshot(self) -> KvStats:
        with self.lock:
            stats = self.store.stats()
        return stats.model_copy(update={"bytes_put": self.bytes_put, "bytes_got": self.bytes_got})
