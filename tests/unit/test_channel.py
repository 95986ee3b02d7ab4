"""llmesh.wire.lifecycle.Channel: a single consumer's queue that keeps order, wakes its waiting consumer,
and survives the consumer's cancellation."""

import asyncio

from llmesh.wire.lifecycle import Channel


def test_items_come_out_in_order_and_a_waiting_consumer_wakes():
    async def main():
        channel: Channel[int] = Channel()
        got = asyncio.ensure_future(channel.get())
        await asyncio.sleep(0)
        assert not got.done()  # nothing yet: it waits
        channel.put(1)
        channel.put(2)
        assert await got == 1 and await channel.get() == 2 and channel.empty()

    asyncio.run(main())


def test_a_cancelled_get_loses_nothing():
    async def main():
        channel: Channel[str] = Channel()
        waiting = asyncio.ensure_future(channel.get())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        channel.put("kept")  # no waiter left to wake: the item stays for the next get
        assert await asyncio.wait_for(channel.get(), 1) == "kept"

    asyncio.run(main())
