"""Process lifecycle for every service: logging, signals, a stop event; and the asyncio helpers they share."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import uvloop


def setup_logging(service: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )


def watch_event_loop(stalled_s: float = 2.0) -> Callable[[], None]:
    """From now on, log when this process's event loop stops turning for `stalled_s` (a blocking call
    on it, or the process starved of CPU): once with where the main thread is, once when it turns
    again. Peers drop a process whose heartbeats stop for about 3 s, so such a stall is worth a line.
    Call it from the loop once the service is up (an engine's start blocks the loop by design);
    call what it returns to stop watching (before a shutdown that blocks, as an engine's does)."""
    loop = asyncio.get_running_loop()
    main_thread = threading.main_thread().ident
    assert main_thread is not None  # it is running
    log = logging.getLogger(__name__)
    stopped = threading.Event()
    last_tick = time.monotonic()

    def tick() -> None:
        nonlocal last_tick
        last_tick = time.monotonic()
        if not stopped.is_set():
            loop.call_later(stalled_s / 4, tick)

    def watch() -> None:
        stalled_since = None
        while not stopped.wait(stalled_s / 4) and not loop.is_closed():
            seen = last_tick
            if time.monotonic() - seen > stalled_s and stalled_since is None:
                stalled_since = seen
                frame = sys._current_frames().get(main_thread)
                stack = "".join(traceback.format_stack(frame)[-8:]) if frame else "(unknown)\n"
                log.warning(
                    "event loop blocked for %.1f s so far; the main thread is at:\n%s",
                    time.monotonic() - seen,
                    stack.rstrip(),
                )
            elif stalled_since is not None and seen != stalled_since:
                log.warning("event loop turned again after %.1f s", seen - stalled_since)
                stalled_since = None

    tick()
    threading.Thread(target=watch, daemon=True, name="event-loop-watchdog").start()
    return stopped.set


def freeze_startup_heap() -> None:
    """Put every object made so far (modules, settings, the app) out of the garbage collector's reach, as vLLM's
    server does once it is up (`vllm.utils.gc_utils.freeze_gc_heap`): a full collection then scans only what
    serving made since. In the router a full collection of its ~90k startup objects took 86 ms (measured, 2 cores):
    a pause in every stream it relays."""
    gc.collect()
    gc.freeze()


T = TypeVar("T")


class Channel(Generic[T]):
    """A queue with one consumer, for the paths a token takes (a reply stream, a request's choices): items
    in a deque and the consumer's one waiting future, without `asyncio.Queue`'s bounds, its getters' and
    putters' lists and its task accounting, which cost several times as much an item (measured: a fifth of the
    router's CPU a token went to its two queues)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def take_all(self) -> list[T]:
        """Every item waiting, at once."""
        items = list(self._items)
        self._items.clear()
        return items

    async def get(self) -> T:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


async def cancel_and_wait(*tasks: asyncio.Future) -> None:
    """Cancel `tasks` and wait until each has ended, reading how (a cancelled task left running still
    holds what it was using, e.g. a generator it is inside; one that failed meanwhile would log its
    error as never retrieved). The caller's own cancellation, if it comes meanwhile, propagates once they
    have ended (anyio's, as Starlette's for a client gone, comes again at every await until then)."""
    for task in tasks:
        task.cancel()
    cancelled: asyncio.CancelledError | None = None
    for task in tasks:
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError as exc:
                cancelled = exc
        if not task.cancelled():
            task.exception()
    if cancelled is not None:
        raise cancelled


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
