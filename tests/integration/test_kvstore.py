"""kv-store shards over a real nats-server: discovery, the direct data plane (shared memory and
plain TCP), eviction and pins, bad frames, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import msgpack
import pytest

from llmesh.engine.kvclient import DISCOVERY_WAIT_S, HostBuffers, KvClient, ShardDirectory, rendezvous_owner
from llmesh.wire.bus import Bus
from llmesh.wire.errors import KVStoreFull, ServiceUnavailable
from llmesh.wire.kvwire import HEADER, MAGIC, recv_header, send_frame
from llmesh.wire.messages import KvShardInfo, KvStats, KvStatsRequest, Subjects
from llmesh_kvstore.dataplane import DataPlaneServer, Tokens
from llmesh_kvstore.service import KvStoreService
from llmesh_kvstore.ssd import SsdTier
from llmesh_kvstore.state import ShardState
from llmesh_kvstore.store import ChunkStore

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def shard(
    url: str, name: str, capacity: int = 64 * 1024**2, ssd: SsdTier | None = None, shared_arena: bool = False
):
    state = ShardState(ChunkStore(capacity, ssd, shared_arena=shared_arena))
    tokens = Tokens(name)
    data_plane = DataPlaneServer(state, "127.0.0.1", 0, max_value_bytes=256 * 1024**2, tokens=tokens)
    bus = await Bus.connect(url, f"kv-{name}")
    service = KvStoreService(
        bus, state, KvShardInfo(shard=name, data_host="127.0.0.1", data_port=data_plane.port, heartbeat_s=0.5), tokens
    )
    await service.start()
    try:
        yield data_plane
    finally:
        await service.stop()
        data_plane.close()
        state.store.arena.close()
        await bus.close()


@contextlib.asynccontextmanager
async def client(url: str, **kwargs):
    bus = await Bus.connect(url, "kv-client")
    directory = ShardDirectory(bus)
    await directory.start()
    kv = KvClient(directory, **kwargs)
    try:
        yield kv
    finally:
        kv.close()
        await bus.close()


async def put(kv: KvClient, keys, values, **kw) -> None:
    await asyncio.to_thread(kv.put, keys, values, **kw)


async def get(kv: KvClient, keys, **kw) -> list[bytes | None]:
    def fetch():
        with kv.get(keys, **kw) as values:
            return [None if v is None else bytes(v) for v in values]

    return await asyncio.to_thread(fetch)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "tcp"])
async def test_put_get_round_trip_and_miss(nats_url, use_shm):
    async with shard(nats_url, f"rt-{use_shm}", shared_arena=True), client(nats_url, use_shm=use_shm) as kv:
        values = [os.urandom(1000), os.urandom(65536), b"", os.urandom(20 * 1024**2)]  # the last grows the segment
        await put(kv, ["a", "b", "c", "d"], values, pin_s=10)
        assert await get(kv, ["b", "missing", "a", "c", "d"]) == [values[1], None, values[0], b"", values[3]]
        assert await get(kv, ["d"]) == [values[3]]
        pool = next(iter(kv._pools.values()))
        conn = pool._idle.get_nowait()
        assert (conn.shm is not None) == use_shm
        pool._idle.put(conn)


async def test_puts_are_written_in_place_into_the_shards_shared_arena(nats_url):
    async with shard(nats_url, "arena", shared_arena=True) as plane:
        big, small = os.urandom(3 * 1024**2), os.urandom(1000)
        async with client(nats_url) as kv:

            def staged():
                with kv.staged_put(["big", "small"], [len(big), len(small)], pin_s=5) as views:
                    assert views[0].obj is views[1].obj  # both in one mapping: the shard's arena
                    views[0][:], views[1][:] = big, small
                kv.put(["copied"], [small])  # a plain put goes the same way, after one copy
                with pytest.raises(RuntimeError):  # a producer failing mid-way stores nothing
                    with kv.staged_put(["lost"], [len(big)]) as views:
                        views[0][:10] = b"x" * 10
                        raise RuntimeError("producer failed")

            await asyncio.to_thread(staged)
            assert await get(kv, ["big", "small", "copied", "lost"]) == [big, small, small, None]
            stats = plane.state.snapshot()
            assert stats.chunks == 3 and stats.bytes_put == len(big) + 2 * len(small)
        for _ in range(50):  # the client closed: the arena space granted to it but unused is back
            if plane.state.snapshot().bytes == len(big) + 2 * len(small):
                break
            await asyncio.sleep(0.05)
        assert plane.state.snapshot().bytes == len(big) + 2 * len(small)


async def test_keys_spread_over_live_shards_by_rendezvous_hashing(nats_url):
    async with shard(nats_url, "s1"), shard(nats_url, "s2"), client(nats_url) as kv:
        for _ in range(50):
            if len(kv.directory.live()) == 2:
                break
            await asyncio.sleep(0.1)
        keys = [f"k{i}" for i in range(40)]
        await put(kv, keys, [k.encode() for k in keys])
        stats = {}
        async with _bus(nats_url) as bus:
            for s in ("s1", "s2"):
                stats[s], _ = await bus.request(Subjects.kv(s, "stats"), KvStatsRequest(), KvStats, timeout=2)
        owners = [rendezvous_owner(k, ["s1", "s2"]) for k in keys]
        assert stats["s1"].chunks == owners.count("s1") and stats["s2"].chunks == owners.count("s2")
        assert 10 <= owners.count("s1") <= 30
        assert await get(kv, keys) == [k.encode() for k in keys]
        # a third shard takes over only the keys it now wins
        moved = [k for k in keys if rendezvous_owner(k, ["s1", "s2", "s3"]) == "s3"]
        assert 0 < len(moved) < len(keys) and all(rendezvous_owner(k, ["s1", "s2"]) != "s3" for k in keys)


@contextlib.asynccontextmanager
async def _bus(url: str):
    bus = await Bus.connect(url, "probe")
    try:
        yield bus
    finally:
        await bus.close()


async def test_lru_eviction_skips_pinned_chunks(nats_url):
    async with shard(nats_url, "lru", capacity=3000), client(nats_url) as kv, _bus(nats_url) as bus:
        await put(kv, ["pinned"], [b"p" * 1000], pin_s=60)
        await put(kv, ["old"], [b"o" * 1000])
        await put(kv, ["new"], [b"n" * 1000])
        await put(kv, ["newest"], [b"x" * 1000])  # must evict "old", not "pinned"
        assert [g is not None for g in await get(kv, ["pinned", "old", "new", "newest"])] == [True, False, True, True]
        with pytest.raises(KVStoreFull):
            await put(kv, ["huge"], [b"h" * 5000])
        assert await get(kv, ["pinned"]) == [b"p" * 1000]  # the connection survived the error
        stats, _ = await bus.request(Subjects.kv("lru", "stats"), KvStatsRequest(), KvStats, timeout=2)
        assert stats.evictions == 1 and stats.pinned_bytes == 1000


def _raw(plane: DataPlaneServer) -> socket.socket:
    """A connection that has shown a valid token."""
    sock = socket.create_connection(("127.0.0.1", plane.port), timeout=5)
    send_frame(sock, {"op": "hello", "token": plane.tokens.mint()})
    assert _reply(sock) == {}
    return sock


def _assert_closed(sock: socket.socket) -> None:
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        pass


def _reply(sock: socket.socket) -> dict:
    got = recv_header(sock, 1 << 30)
    assert got is not None
    return got[0]


async def test_bad_frames_get_clear_errors_and_the_shard_keeps_serving(nats_url):
    async with shard(nats_url, "bad") as plane, client(nats_url) as kv:

        def probe():
            with _raw(plane) as s:  # not our protocol at all: an error, then the connection closes
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert _reply(s)["error"]["code"] == "bad_message"
                _assert_closed(s)
            with _raw(plane) as s:  # a payload larger than the shard accepts
                s.sendall(HEADER.pack(MAGIC, 2, 1 << 40) + msgpack.packb({}))
                assert "exceeds" in _reply(s)["error"]["message"]
                _assert_closed(s)
            with _raw(plane) as s:  # metadata that lies about the payload: error, connection still usable
                send_frame(s, {"op": "put", "keys": ["k"], "sizes": [10]}, [memoryview(b"x" * 4)])
                assert "sizes sum" in _reply(s)["error"]["message"]
                send_frame(s, {"op": "nope"})
                assert "unknown data-plane op" in _reply(s)["error"]["message"]
                send_frame(s, {"op": "attach", "name": "no-such-segment", "size": 4096})
                assert _reply(s)["shm"] is False
                send_frame(s, {"op": "get", "keys": ["k"]})
                assert _reply(s)["sizes"] == [-1]
            with _raw(plane) as s:  # truncated: the peer vanishes mid-payload
                s.sendall(HEADER.pack(MAGIC, 30, 1000) + msgpack.packb({"op": "put", "keys": ["t"], "sizes": [1000]}))
                s.sendall(b"y" * 10)

        await asyncio.to_thread(probe)
        await put(kv, ["still"], [b"works"])
        assert await get(kv, ["still", "t"]) == [b"works", None]


async def test_a_connection_without_a_valid_token_is_refused_before_it_touches_the_store(nats_url, caplog):
    """The door: a token is handed out only in the shard's announcement on NATS; nothing else opens it."""
    async with shard(nats_url, "door") as plane, client(nats_url) as kv:
        await put(kv, ["kept"], [b"v" * 100])
        other_shard = Tokens("door")  # a shard of the same name, but another key
        cases = [
            ({"op": "get", "keys": ["kept"]}, "starts with hello"),
            ({"op": "put", "keys": ["k"], "sizes": [0]}, "starts with hello"),
            ({"op": "hello"}, "not a data-plane token"),
            ({"op": "hello", "token": "9999999999.deadbeef"}, "not a data-plane token"),
            ({"op": "hello", "token": other_shard.mint()}, "not a data-plane token"),
            ({"op": "hello", "token": plane.tokens.mint(ttl_s=-2)}, "expired"),
            ({"op": "hello", "token": plane.tokens.mint() + "0"}, "not a data-plane token"),
        ]

        def probe():
            for first, reason in cases:
                with socket.create_connection(("127.0.0.1", plane.port), timeout=5) as s:
                    send_frame(s, first)
                    error = _reply(s)["error"]
                    assert error["code"] == "unauthenticated" and reason in error["message"], (first, error)
                    _assert_closed(s)
            with socket.create_connection(("127.0.0.1", plane.port), timeout=5) as s:  # not even a frame
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert _reply(s)["error"]["code"] == "unauthenticated"
                _assert_closed(s)

        await asyncio.to_thread(probe)
        refused = [r for r in caplog.records if r.getMessage().startswith("refused a data connection from 127.0.0.1")]
        assert len(refused) == len(cases) + 1
        assert await get(kv, ["kept", "k"]) == [b"v" * 100, None]  # nothing changed; real clients still served


async def test_no_store_is_a_fast_clear_error(nats_url):
    async with client(nats_url, timeout=0.5) as kv:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="no kv-store shard"):
            await get(kv, ["x"])
        assert time.monotonic() - started < 2


async def test_a_store_that_never_came_does_not_hold_each_call_for_the_transfer_timeout(nats_url):
    """Waiting for a first shard is bounded from the client's start, not per call (a decode
    step that loads would otherwise stall the engine for the whole timeout, every time)."""
    async with client(nats_url) as kv:  # the default 30 s transfer timeout
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="no kv-store shard"):
            await get(kv, ["x"])
        assert time.monotonic() - started < DISCOVERY_WAIT_S + 2
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="no kv-store shard"):
            await put(kv, ["y"], [b"value"])
        assert time.monotonic() - started < 1


async def test_prometheus_metrics_report_tiers_and_transfers(nats_url, tmp_path):
    import httpx

    from llmesh.deploy.launcher import free_port
    from llmesh_kvstore.metrics import serve_metrics

    async with (
        shard(nats_url, "metrics", capacity=1500, ssd=SsdTier(tmp_path, 10_000)) as plane,
        client(nats_url) as kv,
    ):
        port = free_port()
        serve_metrics(plane.state.snapshot, "metrics", port)
        await put(kv, ["a"], [b"a" * 1000], pin_s=60)
        with pytest.raises(KVStoreFull):
            await put(kv, ["b"], [b"b" * 1000])  # "a" is pinned: nothing can make room
        await put(kv, ["c"], [b"c" * 400])
        await get(kv, ["a", "missing"])
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        for line in [
            'llmesh_kv_bytes{shard="metrics",tier="memory"} 1400.0',
            'llmesh_kv_hits_total{shard="metrics",tier="memory"} 1.0',
            'llmesh_kv_misses_total{shard="metrics"} 1.0',
            'llmesh_kv_pinned_bytes{shard="metrics"} 1000.0',
            'llmesh_kv_put_bytes_total{shard="metrics"} 2400.0',  # the refused put was received too
            'llmesh_kv_get_bytes_total{shard="metrics"} 1000.0',
            'llmesh_kv_ssd_enabled{shard="metrics"} 1.0',
        ]:
            assert line in text, line


async def test_puts_in_place_span_several_grants_of_arena_space(nats_url):
    async with shard(nats_url, "grants", capacity=64 * 1024**2, shared_arena=True), client(nats_url) as kv:
        # Grants here are 1 MiB (1/64 of the arena): these puts need several, some of them within one
        # put, while other connections take arena space in between.
        values = {f"v{i}": os.urandom(300_000 * (1 + i % 3)) for i in range(48)}
        keys = list(values)

        def put_all(mine: list[str]):
            for i in range(0, len(mine), 3):
                batch = mine[i : i + 3]
                with kv.staged_put(batch, [len(values[k]) for k in batch]) as views:
                    for view, k in zip(views, batch):
                        view[:] = values[k]

        await asyncio.gather(*(asyncio.to_thread(put_all, keys[i::4]) for i in range(4)))
        assert await get(kv, keys) == [values[k] for k in keys]


async def test_a_failed_grant_leaves_no_stale_space_to_write_into(nats_url):
    """A connection's next put needs more than what is left of its grant, and the shard, full of
    pinned chunks, cannot grant it: that remainder went back to the store (another client's chunk
    may lie there now), so the connection's next, smaller put must not be written into it."""
    capacity = 8 * 1024**2  # grants of 128 KiB (1/64 of the arena)
    async with (
        shard(nats_url, "stale", capacity=capacity, shared_arena=True),
        client(nats_url, connections_per_shard=1) as kv,
        client(nats_url) as others,
    ):

        def put_in_place(client_kv, key, value, pin_s=60.0):
            with client_kv.staged_put([key], [len(value)], pin_s=pin_s) as (view,):
                view[:] = value

        await asyncio.to_thread(put_in_place, kv, "first", os.urandom(64 * 1024))  # 64 KiB of its grant left
        filled = 0
        with pytest.raises(KVStoreFull):
            while True:  # pinned chunks everywhere else
                await asyncio.to_thread(put_in_place, others, f"fill{filled}", os.urandom(64 * 1024))
                filled += 1
        with pytest.raises(KVStoreFull):
            await asyncio.to_thread(put_in_place, kv, "big", os.urandom(200 * 1024))  # its grant is given back
        async with client(nats_url) as third:
            victim = os.urandom(64 * 1024)
            await asyncio.to_thread(put_in_place, third, "victim", victim)  # where that remainder was
            small = os.urandom(32 * 1024)
            try:  # a new grant, if the store has room for it
                await asyncio.to_thread(put_in_place, kv, "small", small)
            except KVStoreFull:
                small = None
            assert await get(third, ["victim", "small"]) == [victim, small]


class RecordingBuffers(HostBuffers):
    """Host buffers that record what the client registers and takes (a test double of the GPU host's)."""

    def __init__(self) -> None:
        self.registered: list[int] = []  # sizes of mappings registered and not yet unregistered
        self.taken = self.given = 0

    def take(self, size: int) -> memoryview:
        self.taken += 1
        return super().take(size)

    def give(self, view: memoryview) -> None:
        self.given += 1

    def register(self, view: memoryview) -> None:
        self.registered.append(len(view))

    def unregister(self, view: memoryview) -> None:
        self.registered.remove(len(view))


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "tcp"])
async def test_a_put_and_a_get_say_which_contiguous_memory_holds_which_values(nats_url, use_shm):
    """A device copies a run at once: a staged put's values lie in one run on one shard (the arena's
    granted space, the segment, or a buffer taken for TCP), and so do a get's; mappings are registered
    once each and unregistered when closed, taken buffers given back."""
    buffers = RecordingBuffers()
    async with shard(nats_url, f"runs-{use_shm}", shared_arena=True):
        async with client(nats_url, use_shm=use_shm, buffers=buffers) as kv:
            values = [os.urandom(4096) for _ in range(5)]  # whole cache lines: no gaps between them in the arena
            keys = [f"run-{i}" for i in range(5)]

            def put_then_get():
                with kv.staged_put(keys, [4096] * 5) as staged:
                    ((positions, run),) = staged.runs
                    assert positions == list(range(5)) and len(run) == 5 * 4096
                    run[:] = b"".join(values)
                with kv.get(["missing", *keys]) as fetched:
                    ((positions, run),) = fetched.runs
                    assert positions == [1, 2, 3, 4, 5] and bytes(run) == b"".join(values)

            await asyncio.to_thread(put_then_get)
            await asyncio.to_thread(put_then_get)
            if use_shm:
                assert len(buffers.registered) == 2  # the shard's arena and the connection's segment, once each
                assert buffers.taken == 0
            else:
                assert buffers.registered == [] and buffers.taken == buffers.given == 4
        if use_shm:
            assert len(buffers.registered) == 1  # the segment went with its connection; the arena stays mapped
