"""Run a placement replica: `python -m llmesh_placement` (settings: PlacementSettings)."""

from __future__ import annotations

import asyncio
import os
import socket

from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.lifecycle import run_service, setup_logging, watch_event_loop

from .settings import PlacementSettings


async def main(settings: PlacementSettings, stop: asyncio.Event) -> None:
    from prometheus_client import start_http_server

    from .service import PlacementService

    telemetry.setup_tracing("placement", otlp_endpoint=settings.otlp_endpoint, trace_dir=settings.trace_dir)
    placement_id = settings.placement_id or f"placement-{socket.gethostname()}-{os.getpid()}"
    bus = await Bus.connect(settings.nats_url, placement_id)
    try:
        service = await PlacementService.create(bus, settings, placement_id)
    except BaseException:
        await bus.close()
        raise
    try:
        if settings.placement_metrics_port:
            start_http_server(
                settings.placement_metrics_port, addr=settings.placement_metrics_host, registry=service.registry
            )
        watch_event_loop()
        await service.run(stop)
    finally:
        await service.close()
        await bus.close()


if __name__ == "__main__":
    settings = PlacementSettings()
    setup_logging("placement", settings.log_level)
    run_service(lambda stop: main(settings, stop))
