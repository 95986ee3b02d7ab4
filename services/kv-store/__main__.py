"""Run one kv-store shard: `python -m llmesh_kvstore`."""

from __future__ import annotations

import asyncio

from llmesh import telemetry
from llmesh.bus import Bus
from llmesh.lifecycle import run_service, setup_logging

from .metrics import serve_metrics
from .service import KvStoreService
from .settings import KvStoreSettings
from .ssd import SsdTier
from .store import ChunkStore


async def main(settings: KvStoreSettings, stop: asyncio.Event) -> None:
    telemetry.setup_tracing("kv-store", otlp_endpoint=settings.otlp_endpoint, trace_dir=settings.trace_dir)
    bus = await Bus.connect(settings.nats_url, f"kv-store-{settings.kv_shard}")
    try:
        ssd = SsdTier(settings.data_dir / f"shard-{settings.kv_shard}", settings.ssd_capacity_bytes)
        service = KvStoreService(bus, ChunkStore(settings.capacity_bytes, ssd), settings.kv_shard,
                                 settings.assembly_timeout_s)
        await service.start()
        if settings.metrics_port:
            serve_metrics(service.snapshot, settings.kv_shard, settings.metrics_port, settings.metrics_host)
        await stop.wait()
    finally:
        await bus.close()


if __name__ == "__main__":
    settings = KvStoreSettings()
    setup_logging("kv-store", settings.log_level)
    run_service(lambda stop: main(settings, stop))
