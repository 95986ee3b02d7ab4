"""A kv-store shard's NATS side: announcements (where its data plane listens), stats, flush.

Bulk bytes never cross NATS: they go over the direct data plane (`dataplane.py`).
"""

from __future__ import annotations

import asyncio
import logging

from llmesh.wire.bus import Bus
from llmesh.wire.messages import KvDiscover, KvFlush, KvShardInfo, KvStats, KvStatsRequest, Subjects

from .dataplane import Tokens
from .state import ShardState

log = logging.getLogger(__name__)


class KvStoreService:
    def __init__(self, bus: Bus, state: ShardState, info: KvShardInfo, tokens: Tokens):
        self.bus, self.state, self.info, self.tokens = bus, state, info, tokens
        self._announcer: asyncio.Task | None = None

    async def start(self) -> None:
        await self.bus.serve(Subjects.kv(self.info.shard, "stats"), self.stats, traced=False)
        await self.bus.serve(Subjects.kv(self.info.shard, "flush"), self.flush, span="kv-store flush")
        await self.bus.serve(Subjects.KV_DISCOVER, self.discover, traced=False)
        self._announcer = asyncio.create_task(self._announce_forever())

    async def stop(self) -> None:
        if self._announcer is not None:
            self._announcer.cancel()

    async def _announce_forever(self) -> None:
        while True:
            await self.announce()
            await asyncio.sleep(self.info.heartbeat_s)

    async def announce(self) -> None:
        """Where the data plane listens, with a fresh token for it."""
        await self.bus.publish(Subjects.KV_SHARDS, self.info.model_copy(update={"token": self.tokens.mint()}))

    async def discover(self, msg: KvDiscover, blob: memoryview) -> None:
        await self.announce()

    async def stats(self, msg: KvStatsRequest, blob: memoryview) -> KvStats:
        return await asyncio.to_thread(self.state.snapshot)

    async def flush(self, msg: KvFlush, blob: memoryview) -> KvStats:
        await asyncio.to_thread(self.state.flush_to_ssd)
        return await asyncio.to_thread(self.state.snapshot)
