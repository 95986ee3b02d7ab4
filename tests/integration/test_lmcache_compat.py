"""The kv-store's lm:// endpoint against LMCache 0.5.6 itself: its client class, its reference server.

LMCache runs in its own venv (tests/tool_envs.py; the first run builds it, about a minute or
two). Our server runs in the test process over a real ChunkStore.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import time
from ipaddress import ip_network

import pytest
from tool_envs import lmcache_python

from llmesh_kvstore.lmcache_protocol import start_lmcache_server
from llmesh_kvstore.store import ChunkStore

pytestmark = pytest.mark.timeout(900)  # the first run builds LMCache's venv

REQUEST = struct.Struct("=9i150s")  # restated from lmcache.v1.protocol, independently of our module
REPLY = struct.Struct("=9i")
PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5

# Runs in LMCache's venv: LMCServerConnector does PUT, EXIST and GET; it has no HEALTH or LIST
# method, so those go over its socket as LMCache's own ClientMetaMessage/ServerMetaMessage.
CLIENT = r"""
import asyncio, json, sys, torch
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CASES = [  # shape, dtype, format
    ((2, 4, 256, 64), torch.bfloat16, MemoryFormat.KV_2LTD),
    ((2, 100, 96), torch.float16, MemoryFormat.KV_T2D),
    ((37, 2, 48), torch.float32, MemoryFormat.KV_2TD),
    ((1, 3, 16, 8), torch.float64, MemoryFormat.KV_MLA_FMT),
    ((64, 128), torch.float8_e4m3fn, MemoryFormat.EC_TD),
    ((5, 33), torch.uint8, MemoryFormat.HS_TD),
]

def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("closed")
        buf += part
    return bytes(buf)

async def command(conn, cmd, key):
    async with conn.async_socket_lock:
        conn.client_socket.sendall(ClientMetaMessage(cmd, key, 0, MemoryFormat(1), torch.float16,
                                                     torch.Size([0, 0, 0, 0])).serialize())
        meta = ServerMetaMessage.deserialize(recv_exact(conn.client_socket, ServerMetaMessage.packlength()))
        return meta, recv_exact(conn.client_socket, meta.length) if meta.length else b""

async def main(port):
    config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, max_local_cpu_size=0.25)
    metadata = LMCacheMetadata(model_name="llmesh-test", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(4, 2, 256, 4, 16))
    backend = LocalCPUBackend(config, metadata)
    conn = LMCServerConnector("127.0.0.1", port, asyncio.get_running_loop(), backend)
    out = {}
    meta, _ = await command(conn, ClientCommand.HEALTH, CacheEngineKey("h", 1, 0, 0, torch.bfloat16))
    out["health"] = meta.code == ServerReturnCode.SUCCESS
    keys = [CacheEngineKey("llmesh-test", 1, 0, 0x1000 + i, torch.bfloat16) for i in range(len(CASES) - 1)]
    keys.append(LayerCacheEngineKey("llmesh-test", 1, 0, 0x2000, torch.bfloat16, layer_id=3))
    out["exists_before"] = [await conn.exists(k) for k in keys]
    objs = []
    for key, (shape, dtype, fmt) in zip(keys, CASES):
        obj = backend.allocate(torch.Size(shape), dtype, fmt)
        if dtype.is_floating_point:
            obj.tensor.copy_(torch.randn(shape).to(dtype))
        else:
            obj.tensor.copy_(torch.randint(0, 256, shape, dtype=dtype))
        await conn.put(key, obj)
        objs.append(obj)
    out["exists_after"] = [await conn.exists(k) for k in keys]
    out["gets"] = []
    for key, obj, (shape, dtype, fmt) in zip(keys, objs, CASES):
        got = await conn.get(key)
        out["gets"].append({
            "nbytes": len(obj.byte_array),
            "bytes_equal": got is not None and bytes(got.byte_array) == bytes(obj.byte_array),
            "meta_equal": got is not None and (tuple(got.get_shape()), got.get_dtype(), got.get_memory_format())
                          == (tuple(shape), dtype, fmt),
        })
    out["get_missing"] = await conn.get(CacheEngineKey("llmesh-test", 1, 0, 0xdead, torch.bfloat16)) is None
    out["exists_missing"] = await conn.exists(CacheEngineKey("llmesh-test", 1, 0, 0xdead, torch.bfloat16))
    meta, body = await command(conn, ClientCommand.LIST, keys[0])
    out["list_code"] = int(meta.code)
    out["listed"] = sorted(body.decode().split("\n")) if body else []
    out["keys"] = sorted(k.to_string() for k in keys)
    await conn.close()
    print("RESULT " + json.dumps(out))

asyncio.run(main(int(sys.argv[1])))
"""


@pytest.fixture(scope="module")
def lmcache_py():
    return lmcache_python()


async def _serve(store: ChunkStore, **kwargs):
    server = await start_lmcache_server(store, "127.0.0.1", 0, **kwargs)
    return server, server.sockets[0].getsockname()[1]


async def _run_in_lmcache_env(python, *args: str, timeout: float = 300) -> str:
    """Runs without blocking this loop, which is serving the lm:// endpoint."""
    proc = await asyncio.create_subprocess_exec(
        str(python), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


async def test_lmcache_client_round_trips_through_our_server(lmcache_py):
    store = ChunkStore(256 * 1024**2)
    server, port = await _serve(store)
    try:
        text = await _run_in_lmcache_env(lmcache_py, "-c", CLIENT, str(port))
    finally:
        server.close()
        await server.wait_closed()
    result = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:])
    assert result["health"]
    assert not any(result["exists_before"]) and all(result["exists_after"])
    assert all(g["bytes_equal"] and g["meta_equal"] for g in result["gets"]), result["gets"]
    assert result["get_missing"] and not result["exists_missing"]
    assert result["list_code"] == 200 and result["listed"] == result["keys"]
    assert sorted(store.keys()) == sorted("lmc:" + k for k in result["keys"])  # our namespace in the store
    assert sum(len(store.get("lmc:" + k)) for k in result["keys"]) == sum(g["nbytes"] + 28 for g in result["gets"])


def _request(
    command: int,
    key: str | bytes = "m@1@0@abc@bfloat16",
    length: int = 0,
    fmt: int = 1,
    dtype: int = 2,
    shape=(0, 0, 0, 0),
    location: int = 0,
) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return REQUEST.pack(command, length, fmt, dtype, location, *shape, raw.ljust(150))


# A request sequence with every reply shape: misses, hits of several formats, dtypes (1, half,
# is answered as 2, float16), shapes with inner zeros, an empty value, a repeated put, ignored
# lengths. (No overwrite with different content: LMCache's server keeps the last put, our store
# the first; LMCache keys hash the tokens, so a key's content does not change.)
_A1 = os.urandom(100)
SEQUENCE = [
    (_request(HEALTH), b""),
    (_request(EXIST), b""),
    (_request(GET), b""),
    (_request(PUT, length=256, fmt=1, dtype=3, shape=(2, 2, 4, 8)), os.urandom(256)),
    (_request(PUT, "m@1@0@a1@half", length=100, fmt=5, dtype=1, shape=(100, 0, 0, 0)), _A1),
    (_request(PUT, "m@1@0@a2@bfloat16@3", length=0, fmt=0, dtype=0), b""),
    (_request(PUT, "m@1@0@a3@float", length=60, fmt=3, dtype=8, shape=(3, 0, 5, 0), location=2), os.urandom(60)),
    (_request(EXIST), b""),
    (_request(GET), b""),
    (_request(GET, "m@1@0@a1@half"), b""),
    (_request(GET, "m@1@0@a2@bfloat16@3"), b""),
    (_request(GET, "m@1@0@a3@float"), b""),
    (_request(PUT, "m@1@0@a1@half", length=100, fmt=5, dtype=1, shape=(100, 0, 0, 0)), _A1),  # same again
    (_request(GET, "m@1@0@a1@half"), b""),
    (_request(HEALTH, length=12345, fmt=7, dtype=5, shape=(9, 9, 9, 9)), b""),
    (_request(EXIST, "m@1@0@ffff@bfloat16"), b""),
]


async def _replay(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    replies = bytearray()
    try:
        for header, payload in SEQUENCE:
            writer.write(header + payload)
            if struct.unpack_from("=i", header)[0] == PUT:
                continue
            reply = await asyncio.wait_for(reader.readexactly(REPLY.size), 10)
            code, length = REPLY.unpack(reply)[:2]
            replies += reply
            if struct.unpack_from("=i", header)[0] == GET and code == 200:
                replies += await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()
    return bytes(replies)


async def test_replies_equal_lmcache_reference_server_byte_for_byte(lmcache_py):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ref_port = s.getsockname()[1]
    ref = await asyncio.create_subprocess_exec(
        str(lmcache_py),
        "-m",
        "lmcache.v1.server",
        "127.0.0.1",
        str(ref_port),
        "cpu",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    server, port = await _serve(ChunkStore(64 * 1024**2))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", ref_port)
                w.close()
                break
            except OSError:
                assert ref.returncode is None and time.monotonic() < deadline, "reference server did not start"
                await asyncio.sleep(0.2)
        theirs, ours = await _replay(ref_port), await _replay(port)
        assert len(ours) > 13 * REPLY.size
        assert ours == theirs
    finally:
        ref.terminate()
        await ref.wait()
        server.close()
        await server.wait_closed()


async def _closed_by_server(raw: bytes, port: int) -> bool:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()


async def _health(reader, writer) -> int:
    writer.write(_request(HEALTH))
    return REPLY.unpack(await asyncio.wait_for(reader.readexactly(REPLY.size), 10))[0]


async def test_bad_input_closes_only_that_connection(caplog):
    store = ChunkStore(1024**2)
    server, port = await _serve(store, max_value_bytes=4 * 1024**2)
    caplog.set_level(logging.WARNING, "llmesh_kvstore.lmcache_protocol")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a good client, open throughout
        assert await _health(reader, writer) == 200
        assert await _closed_by_server(b"\xff" * REQUEST.size, port)  # unknown command -1
        assert await _closed_by_server(_request(99), port)
        assert await _closed_by_server(_request(PUT, length=4 * 1024**2 + 1), port)  # over max_value_bytes
        assert await _closed_by_server(_request(PUT, length=-5), port)
        assert await _closed_by_server(_request(GET, dtype=42), port)
        assert await _closed_by_server(_request(GET, fmt=10), port)
        assert await _closed_by_server(_request(EXIST, key=b"\xff\xfe"), port)
        assert await _closed_by_server(_request(EXIST, key=""), port)
        for raw in (_request(HEALTH)[:100], _request(PUT, "m@1@0@cut@half", length=1000) + b"x" * 10):
            _, w = await asyncio.open_connection("127.0.0.1", port)  # closed mid-message by the client
            w.write(raw)
            await w.drain()
            w.close()
            await w.wait_closed()
        # Larger than the store but allowed on the wire: read, dropped with a warning, connection kept.
        writer.write(_request(PUT, "m@1@0@big@half", length=2 * 1024**2) + bytes(2 * 1024**2))
        assert await _health(reader, writer) == 200
        writer.write(_request(PUT, length=5) + b"hello" + _request(GET))
        reply = REPLY.unpack(await asyncio.wait_for(reader.readexactly(REPLY.size), 10))
        assert reply[:2] == (200, 5) and await reader.readexactly(5) == b"hello"
        writer.close()
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)  # and a new client is served
        assert await _health(r2, w2) == 200
        w2.close()
        await asyncio.sleep(0.1)
        assert sorted(store.keys()) == ["lmc:m@1@0@abc@bfloat16"]
        messages = "\n".join(r.getMessage() for r in caplog.records)
        assert messages.count("refused") == 8 and messages.count("mid-message") == 2, messages
        assert "dropped" in messages
    finally:
        server.close()
        await server.wait_closed()


async def test_clients_from_outside_the_allowed_networks_are_cut_off(caplog):
    """LMCache's protocol has no credential: the lm:// door is by address (loopback by default). A
    client from 127.0.0.2 stands in for another host."""
    store = ChunkStore(1024**2)
    caplog.set_level(logging.WARNING, "llmesh_kvstore.lmcache_protocol")
    server, port = await _serve(store)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        writer.write(_request(PUT, length=5) + b"hello" + _request(HEALTH))
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(reader.readexactly(REPLY.size), 10)
        writer.close()
        assert not store.keys()
        assert "lm:// refused a connection from ('127.0.0.2'" in caplog.text
        local_reader, local_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _health(local_reader, local_writer) == 200
        local_writer.close()
    finally:
        server.close()
        await server.wait_closed()
    wider, port = await _serve(store, allow=[ip_network("127.0.0.0/8")])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        assert await _health(reader, writer) == 200
        writer.close()
    finally:
        wider.close()
        await wider.wait_closed()
