"""Run the router: `python -m llmesh_router` (settings: RouterSettings, env prefix MESH_)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterator

import uvicorn

from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.lifecycle import freeze_startup_heap, run_service, setup_logging, watch_event_loop
from llmesh.wire.messages import Subjects, WorkerInfo

from .asgi import StampedProtocol
from .dispatch import Dispatcher
from .lengths import LengthTagger
from .metrics import RouterMetrics
from .parsed_output import OutputParsers
from .registry import WorkerRegistry
from .responses import ResponseStore
from .scheduler import Scheduler
from .service import create_app
from .settings import RouterSettings

log = logging.getLogger("llmesh_router")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `run_service` owns the signals and `stop`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def publish_traffic(bus: Bus, scheduler: Scheduler, router_id: str, every_s: float = 1.0) -> None:
    """Requests by model, for placement (which activates a model that requests wait for)."""
    while True:
        try:
            await bus.publish(Subjects.TRAFFIC, scheduler.traffic(router_id))
        except Exception as exc:  # NATS away for a moment: the next one tells
            log.warning("could not publish the traffic: %s", exc)
        await asyncio.sleep(every_s)


async def main(settings: RouterSettings, stop: asyncio.Event) -> None:
    telemetry.setup_tracing("router", otlp_endpoint=settings.otlp_endpoint, trace_dir=settings.trace_dir)
    if parsed := [m for m in settings.catalogue() if m.tool_call_parser or m.reasoning_parser]:
        named = [f"{m.name} ({' and '.join(filter(None, (m.tool_call_parser, m.reasoning_parser)))})" for m in parsed]
        log.info("loading the output parsers of %s", ", ".join(named))
    output_parsers = await asyncio.to_thread(OutputParsers, parsed, settings.model_dir)
    bus = await Bus.connect(settings.nats_url, "router")
    policy, queue_policy = settings.dispatch_policy(), settings.admission_policy()
    registry = WorkerRegistry(settings.missed_heartbeats, settings.catalogue())
    scheduler = Scheduler(
        registry,
        policy,
        queue_policy=queue_policy,
        max_waiting=settings.queue_max_waiting,
        max_wait_s=settings.queue_max_wait_s,
        max_backlog_s=settings.prefill_max_queue_s,
        local_prefill_margin_s=settings.local_prefill_margin_s,
        tpot_slo_s=settings.slo_tpot_ms / 1000,
        model_wait_s=settings.model_wait_s,
        seed=settings.seed,
    )

    async def on_heartbeat(info: WorkerInfo, blob: memoryview) -> None:
        registry.on_heartbeat(info)

    await bus.serve(Subjects.HEARTBEAT, on_heartbeat, traced=False)
    expiry = asyncio.create_task(registry.run_expiry())
    metrics = RouterMetrics()
    lengths = LengthTagger(
        bus,
        metrics,
        settings.length_predict_timeout_s,
        before_dispatch=policy.needs_prediction or queue_policy.needs_prediction,
        sample_fraction=settings.length_sample_fraction,
        seed=settings.seed,
    )
    dispatcher = Dispatcher(bus, scheduler, lengths, metrics)
    keys = settings.keyring()
    if keys.enabled:
        log.info("the OpenAI API needs one of %d API keys", len(keys))
    else:
        log.warning("no API keys configured: anyone who reaches %s:%d can use the API", settings.host, settings.port)
    admin_keys = settings.admin_keyring()
    if not admin_keys.enabled:
        log.info("no admin keys: /v1/load_lora_adapter and /v1/unload_lora_adapter are closed")
    response_store = ResponseStore(settings.responses_redis_url or settings.redis_url, settings.responses_ttl_s)
    app = create_app(
        dispatcher,
        registry,
        metrics,
        settings.request_timeout_s,
        keys,
        output_parsers,
        settings.max_request_bytes,
        response_store,
        admin_keys,
    )
    # Idle connections live longer than clients' own keep-alive (aiohttp 15 s, load balancers 60 s): with
    # uvicorn's 5 s, a client reusing a connection as the router closed it saw "Server disconnected".
    server = _Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="warning",
            timeout_graceful_shutdown=settings.shutdown_grace_s,
            timeout_keep_alive=75,
            http=StampedProtocol,
        )
    )
    serving = asyncio.create_task(server.serve())
    traffic = asyncio.create_task(publish_traffic(bus, scheduler, f"router-{socket.gethostname()}-{os.getpid()}"))
    watch_event_loop()
    freeze_startup_heap()
    try:
        await asyncio.wait({serving, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        server.should_exit = True
        await serving
        expiry.cancel()
        traffic.cancel()
        await response_store.aclose()
        await bus.close()


if __name__ == "__main__":
    settings = RouterSettings()
    setup_logging("router", settings.log_level)
    run_service(lambda stop: main(settings, stop))
