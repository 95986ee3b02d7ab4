"""Run a length-predictor replica: `python -m llmesh_lengthpred` (settings: LengthPredictorSettings)."""

from __future__ import annotations

import asyncio
import os
import socket

from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.lifecycle import run_service, setup_logging, watch_event_loop

from .settings import LengthPredictorSettings


async def main(settings: LengthPredictorSettings, stop: asyncio.Event) -> None:
    from prometheus_client import start_http_server

    from .service import LengthPredictorService

    telemetry.setup_tracing("length-predictor", otlp_endpoint=settings.otlp_endpoint, trace_dir=settings.trace_dir)
    replica = settings.length_replica or f"length-{socket.gethostname()}-{os.getpid()}"
    bus = await Bus.connect(settings.nats_url, replica)
    try:
        service = await LengthPredictorService.create(bus, settings, replica)
    except BaseException:
        await bus.close()
        raise
    try:
        await service.start()
        watch_event_loop()
        if settings.length_metrics_port:
            start_http_server(
                settings.length_metrics_port, addr=settings.length_metrics_host, registry=service.registry
            )
        await stop.wait()
    finally:
        await bus.close()
        await service.close()


if __name__ == "__main__":
    settings = LengthPredictorSettings()
    setup_logging("length-predictor", settings.log_level)
    run_service(lambda stop: main(settings, stop))
