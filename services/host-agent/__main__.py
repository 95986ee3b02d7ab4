"""Run a host agent: `python -m llmesh_hostagent` (settings: HostAgentSettings)."""

from __future__ import annotations

import asyncio

from llmesh.wire.bus import Bus
from llmesh.wire.lifecycle import run_service, setup_logging, watch_event_loop

from .service import HostAgent
from .settings import HostAgentSettings


async def main(settings: HostAgentSettings, stop: asyncio.Event) -> None:
    bus = await Bus.connect(settings.nats_url, f"host-agent-{settings.host()}")
    agent = HostAgent(bus, settings)
    try:
        await agent.start()
        watch_event_loop()
        await agent.run(stop)
    finally:
        agent.close()
        await bus.close()


if __name__ == "__main__":
    settings = HostAgentSettings()
    setup_logging("host-agent", settings.log_level)
    run_service(lambda stop: main(settings, stop))
