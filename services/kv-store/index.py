"""The shared chunk index in Redis: which shard holds each chunk, its size and last access.

Shards share one key space: a chunk lives on the shard its key wins by rendezvous hashing
(llmesh.engine.kvclient), and the index records where chunks actually are, so a client finds a
chunk stored before the membership changed (`kvclient.ChunkLocator`) and operators can see
the whole store. One hash, `llmesh:kv:chunks`, maps chunk key -> "shard size last_access".

Updates are queued by the store's callers and written in pipelined batches off the data
path. If Redis is unreachable the shard keeps serving what it holds and logs it once per
outage; queued updates are then dropped, and when Redis is back the shard re-publishes its
whole holding, so nothing is lost from the index for good.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import redis.asyncio as aioredis
import redis.exceptions

from llmesh.wire.kvkeys import INDEX_KEY, encode_entry
from llmesh.wire.secrets import redacted

from .state import ShardState

log = logging.getLogger(__name__)

REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisIndex:
    def __init__(self, url: str, shard: str, state: ShardState, *, flush_s: float = 0.1, timeout_s: float = 1.0):
        self.shard, self.state, self.flush_s = shard, state, flush_s
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url = redacted(url)  # for logs
        self._updates: dict[str, int | None] = {}  # key -> size to record, None to remove
        self._accessed: set[str] = set()
        self._lock = threading.Lock()
        self._resync = True  # publish everything held at start (e.g. SSD chunks after a restart)
        self.connected = False
        self.writes = self.failures = 0
        state.on_put = self._on_put
        state.on_access = self._on_access
        state.store.on_drop = self._on_drop

    # called from data-plane threads and the store, under or outside the shard lock
    def _on_put(self, items: list[tuple[str, int]]) -> None:
        with self._lock:
            self._updates.update(items)

    def _on_access(self, keys: list[str]) -> None:
        with self._lock:
            self._accessed.update(keys)

    def _on_drop(self, key: str) -> None:
        with self._lock:
            self._updates[key] = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await self.flush()
            except REDIS_ERRORS as exc:
                self.failures += 1
                if self.connected or self.failures == 1:
                    log.error(
                        "Redis at %s is unreachable (%s): serving on, the index is re-published when it is back",
                        self.url,
                        exc,
                    )
                self.connected = False
                self._resync = True

    async def flush(self) -> None:
        """Write what changed (everything held, after a start or an outage)."""
        with self._lock:
            updates, self._updates = self._updates, {}
            accessed, self._accessed = self._accessed, set()
        if self._resync:
            updates = await asyncio.to_thread(self._holding) | updates
        now = time.time()
        sizes = {k: s for k, s in updates.items() if s is not None}
        for key in accessed - sizes.keys():
            size = self.state.store.size_of(key)
            if size is not None:
                sizes[key] = size
        removed = [k for k, s in updates.items() if s is None]
        if not sizes and not removed and self.connected:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for start in range(0, len(sizes), 1000):
                batch = list(sizes.items())[start : start + 1000]
                pipe.hset(INDEX_KEY, mapping={k: encode_entry(self.shard, s, now) for k, s in batch})
            if removed:
                pipe.hdel(INDEX_KEY, *removed)
            pipe.ping()
            await pipe.execute()
        self.writes += len(sizes) + len(removed)
        if not self.connected:
            log.info(
                "Redis index at %s: %s",
                self.url,
                f"re-published {len(sizes)} chunks" if self._resync else "connected",
            )
        self.connected, self._resync = True, False

    def _holding(self) -> dict[str, int | None]:
        with self.state.lock:
            store = self.state.store
            return {k: store.size_of(k) for k in store.keys()}

    async def close(self) -> None:
        try:
            await self.flush()
        except REDIS_ERRORS:
            pass
        await self.redis.aclose()
