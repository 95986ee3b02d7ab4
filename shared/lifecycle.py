"""Process lifecycle for every service: logging, signals, a stop event."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable


def setup_logging(service: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)`; SIGINT/SIGTERM set `stop`, and `main` is expected to return soon after."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())
