"""kv-store over a real nats-server: round trips, splitting, eviction, pins, bad input."""

from __future__ import annotations

import os
import time

import pytest

from llmesh.bus import Bus
from llmesh.errors import BadMessage, KVStoreFull, ServiceUnavailable
from llmesh.kvclient import KvClient
from llmesh.messages import Ack, KvPut, KvStats, KvStatsRequest, Subjects
from llmesh_kvstore.service import KvStoreService
from llmesh_kvstore.store import ChunkStore

pytestmark = pytest.mark.timeout(60)


async def _store(url: str, shard: str, capacity: int = 64 * 1024**2):
    server_bus = await Bus.connect(url, f"kv-{shard}")
    await KvStoreService(server_bus, ChunkStore(capacity), shard).start()
    client_bus = await Bus.connect(url, f"client-{shard}")
    return server_bus, client_bus, KvClient(client_bus, shard)


async def test_put_get_round_trip_and_miss(nats_url):
    server, bus, kv = await _store(nats_url, "rt")
    try:
        values = [os.urandom(1000), os.urandom(65536), b""]
        await kv.put(["a", "b", "c"], values, pin_s=10)
        got = await kv.get(["b", "missing", "a", "c"])
        assert [None if g is None else bytes(g) for g in got] == [values[1], None, values[0], b""]
    finally:
        await bus.close()
        await server.close()


async def test_values_larger_than_payload_are_split_and_reassembled(small_payload_nats_url):
    server, bus, kv = await _store(small_payload_nats_url, "split")
    try:
        assert bus.max_payload < 1024**2
        values = [os.urandom(700_000), os.urandom(300_000)]
        await kv.put(["big", "medium"], values)
        got = await kv.get(["medium", "big"])
        assert bytes(got[0]) == values[1] and bytes(got[1]) == values[0]
    finally:
        await bus.close()
        await server.close()


async def test_lru_eviction_skips_pinned_chunks(nats_url):
    server, bus, kv = await _store(nats_url, "lru", capacity=3000)
    try:
        await kv.put(["pinned"], [b"p" * 1000], pin_s=60)
        await kv.put(["old"], [b"o" * 1000])
        await kv.put(["new"], [b"n" * 1000])
        await kv.put(["newest"], [b"x" * 1000])  # must evict "old", not "pinned"
        got = await kv.get(["pinned", "old", "new", "newest"])
        assert [g is not None for g in got] == [True, False, True, True]
        with pytest.raises(KVStoreFull):
            await kv.put(["huge"], [b"h" * 5000])
        stats, _ = await bus.request(Subjects.kv("lru", "stats"), KvStatsRequest(), KvStats, timeout=2)
        assert stats.evictions == 1 and stats.pinned_bytes == 1000
    finally:
        await bus.close()
        await server.close()


async def test_malformed_messages_get_clear_errors_and_store_keeps_serving(nats_url):
    server, bus, kv = await _store(nats_url, "bad")
    try:
        with pytest.raises(BadMessage, match="disagree"):
            await bus.request(Subjects.kv("bad", "put"),
                              KvPut(transfer_id="t", keys=["k"], sizes=[10], total_size=99), Ack,
                              timeout=2, blob=b"x" * 10)
        reply = await bus.nc.request(Subjects.kv("bad", "put"), b"\x00\x00\x00\x05garbage", timeout=2)
        with pytest.raises(BadMessage):
            from llmesh.messages import decode_any

            decode_any(reply.data)
        await kv.put(["still"], [b"works"])
        assert bytes((await kv.get(["still"]))[0]) == b"works"
    finally:
        await bus.close()
        await server.close()


async def test_no_store_is_a_fast_clear_error(nats_url):
    bus = await Bus.connect(nats_url, "lonely")
    try:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            await KvClient(bus, "nobody").get(["x"])
        assert time.monotonic() - started < 1
    finally:
        await bus.close()
