"""A blocked event loop is logged with where the main thread is, and again when it turns."""

import asyncio
import logging
import time

from llmesh.wire.lifecycle import watch_event_loop


def test_a_blocked_loop_is_logged_with_its_stack_and_its_length(caplog):
    def blocking_call() -> None:
        time.sleep(1.0)  # what a synchronous call on the loop does to heartbeats

    async def main() -> None:
        watch_event_loop(stalled_s=0.4)
        await asyncio.sleep(0.3)  # turning: nothing to say
        blocking_call()
        await asyncio.sleep(0.5)  # turning again

    with caplog.at_level(logging.WARNING, logger="llmesh.wire.lifecycle"):
        asyncio.run(main())
    blocked, turned = [r.getMessage() for r in caplog.records]
    assert "event loop blocked for" in blocked and "blocking_call" in blocked and "time.sleep" in blocked
    assert 0.8 < float(turned.split("after ")[1].split(" s")[0]) < 1.5
