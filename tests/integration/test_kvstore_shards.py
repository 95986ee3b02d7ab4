"""Two kv-store shard processes sharing one key space through Redis: keys spread over both,
either can be killed and restarted without losing its SSD-resident chunks, and Redis going
away costs nothing but the index until it is back."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
import redis

from llmesh.deploy.launcher import free_port, start_redis, start_service
from llmesh.engine.kvclient import ChunkLocator, KvClient, ShardDirectory, rendezvous_owner
from llmesh.wire.bus import Bus
from llmesh.wire.errors import MeshError
from llmesh.wire.kvkeys import INDEX_KEY, decode_entry
from llmesh.wire.messages import KvFlush, KvStats, Subjects
from llmesh_kvstore.lmcache_protocol import HEALTH, REPLY, REQUEST, SUCCESS

pytestmark = pytest.mark.timeout(120)

SHARDS = ("a", "b")


LMCACHE_PORT = free_port()


def start_shard(name: str, nats_url: str, redis_url: str, data_dir, logs):
    env = {
        "MESH_NATS_URL": nats_url,
        "MESH_REDIS_URL": redis_url,
        "MESH_KV_SHARD": name,
        "MESH_DATA_DIR": str(data_dir),
        "MESH_CAPACITY_BYTES": str(64 * 1024**2),
        "MESH_HEARTBEAT_S": "0.3",
        "MESH_LMCACHE_PORT": str(LMCACHE_PORT) if name == "a" else "0",
    }
    return start_service("kv-store", env, logs / f"kv-{name}-{time.monotonic_ns()}.log")


async def wait_for(predicate, timeout: float, what: str):
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if await asyncio.to_thread(predicate):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def lmcache_health(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(REQUEST.pack(HEALTH, 0, 0, 0, 0, 0, 0, 0, 0, b"health".ljust(150)))
        reply = bytearray(REPLY.size)
        view = memoryview(reply)
        while view:
            n = sock.recv_into(view)
            assert n, "lm:// endpoint closed the connection"
            view = view[n:]
        return REPLY.unpack(reply)[0]


def index_entries(r: redis.Redis) -> dict[str, str]:
    return {k.decode(): decode_entry(v)[0] for k, v in r.hgetall(INDEX_KEY).items()}


def indexed(r: redis.Redis, owners: dict[str, str]) -> bool:
    entries = index_entries(r)
    return all(entries.get(k) == s for k, s in owners.items())


async def test_two_shards_share_one_key_space_and_survive_restarts(nats_url, tmp_path):
    redis_child, redis_url = start_redis(log_path=tmp_path / "redis.log")
    r = redis.Redis.from_url(redis_url)
    shards = {"a": start_shard("a", nats_url, redis_url, tmp_path / "data", tmp_path)}
    bus = await Bus.connect(nats_url, "shards-test")
    directory = ShardDirectory(bus)
    await directory.start()
    kv = KvClient(directory, timeout=10, locator=ChunkLocator(redis_url))
    try:
        # chunks stored while "a" is alone stay where they are when "b" joins; the index finds them
        await wait_for(lambda: set(directory.live()) == {"a"}, 30, "shard a to announce")
        early = {f"early-{i}": os.urandom(1000) for i in range(30)}
        await asyncio.to_thread(kv.put, list(early), list(early.values()))
        await wait_for(lambda: len(index_entries(r)) == len(early), 5, "the index to list the early chunks")
        shards["b"] = start_shard("b", nats_url, redis_url, tmp_path / "data", tmp_path)
        await wait_for(lambda: set(directory.live()) == set(SHARDS), 30, "both shards to announce")
        assert any(rendezvous_owner(k, sorted(SHARDS)) == "b" for k in early)  # some changed owner ...
        with kv.get(list(early)) as got:  # ... and are read from "a" all the same
            assert [bytes(v) for v in got] == list(early.values())
        assert all(await asyncio.to_thread(kv.contains, list(early)))

        keys = [f"chunk-{i}" for i in range(60)]
        values = {k: os.urandom(64 * 1024) for k in keys}
        await asyncio.to_thread(kv.put, keys, [values[k] for k in keys])
        owners = {k: rendezvous_owner(k, sorted(SHARDS)) for k in keys}
        for s in SHARDS:
            stats, _ = await bus.request(Subjects.kv(s, "flush"), KvFlush(), KvStats, timeout=10)
            early_here = sum(1 for k in early if index_entries(r).get(k) == s)
            assert stats.ssd_chunks == list(owners.values()).count(s) + early_here, s  # spread, now on SSD
            assert list(owners.values()).count(s) > 10, s
        await wait_for(lambda: indexed(r, owners), 5, "the Redis index to list every chunk's shard")
        assert await asyncio.to_thread(lmcache_health, LMCACHE_PORT) == SUCCESS  # shard a also speaks lm://

        def all_there() -> bool:
            try:
                with kv.get(keys) as got:
                    return all(v is not None and bytes(v) == values[k] for k, v in zip(keys, got))
            except MeshError:  # the restarted shard is not announced yet
                return False

        for s in SHARDS:  # kill each shard in turn, restart it on the same directory
            shards[s].kill()
            r.hdel(INDEX_KEY, *[k for k in keys if owners[k] == s])  # proves the restart re-publishes
            shards[s] = start_shard(s, nats_url, redis_url, tmp_path / "data", tmp_path)
            await wait_for(all_there, 30, f"shard {s}'s chunks to be served again")
            await wait_for(lambda: indexed(r, owners), 5, "the restarted shard to re-publish its index")

        # Redis goes away: the shards serve on and say so; when it is back, the index is rebuilt
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        redis_child.stop()
        await asyncio.to_thread(kv.put, ["after-redis"], [b"still stored"])
        assert await asyncio.to_thread(all_there)
        await asyncio.sleep(0.5)
        redis_child, _ = start_redis(redis_port, log_path=tmp_path / "redis-2.log")
        owners["after-redis"] = rendezvous_owner("after-redis", sorted(SHARDS))
        await wait_for(lambda: indexed(r, owners), 10, "the index to be re-published after the outage")
        logs = "".join(p.read_text() for p in tmp_path.glob("kv-*.log"))
        assert "is unreachable" in logs and "re-published" in logs
    finally:
        kv.close()
        await bus.close()
        for child in shards.values():
            child.stop()
        redis_child.stop()
