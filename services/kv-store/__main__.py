"""Run one kv-store shard: `python -m llmesh_kvstore`."""

from __future__ import annotations

import asyncio

from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.lifecycle import run_service, setup_logging, watch_event_loop
from llmesh.wire.messages import KvShardInfo

from .dataplane import DataPlaneServer, Tokens
from .index import RedisIndex
from .lmcache_protocol import start_lmcache_server
from .metrics import serve_metrics
from .service import KvStoreService
from .settings import KvStoreSettings
from .ssd import SsdTier
from .state import ShardState
from .store import ChunkStore


async def main(settings: KvStoreSettings, stop: asyncio.Event) -> None:
    telemetry.setup_tracing("kv-store", otlp_endpoint=settings.otlp_endpoint, trace_dir=settings.trace_dir)
    ssd = SsdTier(settings.data_dir / f"shard-{settings.kv_shard}", settings.ssd_capacity_bytes)
    state = ShardState(ChunkStore(settings.capacity_bytes, ssd, shared_arena=settings.shared_arena))
    state.start_cleaner(settings.ssd_clean_watermark, unread_too=settings.ssd_admission == "all")
    tokens = Tokens(settings.kv_shard)
    data_plane = DataPlaneServer(state, settings.data_host, settings.data_port, settings.max_value_bytes, tokens)
    info = KvShardInfo(
        shard=settings.kv_shard,
        data_host=settings.data_advertise_host or settings.data_host,
        data_port=data_plane.port,
        heartbeat_s=settings.heartbeat_s,
    )
    bus = await Bus.connect(settings.nats_url, f"kv-store-{settings.kv_shard}")
    service = KvStoreService(bus, state, info, tokens)
    index = RedisIndex(settings.redis_url, settings.kv_shard, state) if settings.redis_url else None
    index_task = asyncio.create_task(index.run()) if index else None
    lmcache = None
    try:
        await service.start()
        watch_event_loop()
        if settings.lmcache_port:
            lmcache = await start_lmcache_server(
                state.store,
                settings.data_host,
                settings.lmcache_port,
                lock=state.lock,
                max_value_bytes=settings.max_value_bytes,
                allow=settings.lmcache_networks(),
            )
        if settings.metrics_port:
            serve_metrics(state.snapshot, settings.kv_shard, settings.metrics_port, settings.metrics_host)
        await stop.wait()
    finally:
        try:
            if lmcache is not None:
                lmcache.close()
            if index is not None:
                assert index_task is not None
                index_task.cancel()
                await index.close()
            await service.stop()
            await bus.close()
        finally:  # local resources go even if the network part of the shutdown was cut short
            state.stop()
            data_plane.close()
            state.store.arena.close()


if __name__ == "__main__":
    settings = KvStoreSettings()
    setup_logging("kv-store", settings.log_level)
    run_service(lambda stop: main(settings, stop))
