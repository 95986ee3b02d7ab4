"""Process lifecycle for every service: logging, signals, a stop event."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import uvloop


def setup_logging(service: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )


GRACE_S = 8.0  # after a signal, how long `main` may take to shut down before it is cancelled


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` on uvloop; SIGINT/SIGTERM set `stop` and `main` should return soon after.

    uvloop, as vLLM's and uvicorn's own servers run: every token crosses a few sockets in each
    service, and uvloop spends less CPU per socket operation than asyncio's own loop (docs/benchmarks.md).

    A `main` that does not (it may still be starting, e.g. waiting for NATS) is cancelled
    after GRACE_S, or at once on a second signal.
    """

    async def supervised() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(main(stop))

        def on_signal() -> None:
            if stop.is_set():
                task.cancel()
                return
            stop.set()
            loop.call_later(GRACE_S, task.cancel)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            await task
        except asyncio.CancelledError:
            logging.getLogger(__name__).warning("stopped before finishing its shutdown", exc_info=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(supervised())
