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


async def test_prometheus_metrics_report_tiers_and_transfers(nats_url, tmp_path):
    import httpx
    from llmesh.launcher import free_port
    from llmesh_kvstore.metrics import serve_metrics
    from llmesh_kvstore.ssd import SsdTier

    server_bus = await Bus.connect(nats_url, "kv-metrics")
    service = KvStoreService(server_bus, ChunkStore(1500, SsdTier(tmp_path, 10_000)), "metrics")
    await service.start()
    client_bus = await Bus.connect(nats_url, "client-metrics")
    kv = KvClient(client_bus, "metrics")
    port = free_port()
    serve_metrics(service.snapshot, "metrics", port)
    try:
        await kv.put(["a"], [b"a" * 1000], pin_s=60)
        await kv.put(["b"], [b"b" * 1000])  # "a" is pinned: nothing can make room
    except KVStoreFull:
        pass
    try:
        await kv.put(["c"], [b"c" * 400])
        await kv.get(["a", "missing"])
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        for line in ['llmesh_kv_bytes{shard="metrics",tier="memory"} 1400.0',
                     'llmesh_kv_hits_total{shard="metrics",tier="memory"} 1.0',
                     'llmesh_kv_misses_total{shard="metrics"} 1.0',
                     'llmesh_kv_pinned_bytes{shard="metrics"} 1000.0',
                     'llmesh_kv_put_bytes_total{shard="metrics"} 2400.0',  # the refused put was received too
                     'llmesh_kv_get_bytes_total{shard="metrics"} 1000.0',
                     'llmesh_kv_ssd_enabled{shard="metrics"} 1.0']:
            assert line in text, line
    finally:
        await client_bus.close()
        await server_bus.close()
