"""LMCache's `lm://` remote protocol (as LMCache 0.5.6's `lmcache.v1.server` speaks it) over the shard's store.

Wire format: `lmcache.v1.protocol`, native byte order (little-endian on x86 and ARM), no padding.

Request, 186 bytes, struct "iiiiiiiii150s":
    command   1 PUT, 2 GET, 3 EXIST, 4 LIST, 5 HEALTH
    length    payload bytes that follow (PUT); 0 otherwise
    fmt       MemoryFormat value, 0..9
    dtype     0 none, 1 half, 2 float16, 3 bfloat16, 4 float32, 5 float64, 6 uint8, 7 float8_e4m3fn,
              8 float8_e5m2
    location  0 none, 1 LocalCPUBackend, 2 LocalDiskBackend (read and ignored)
    shape     4 ints, the memory object's shape padded with trailing zeros
    key       CacheEngineKey.to_string(), right-padded with spaces to 150 bytes
Reply, 36 bytes, struct "iiiiiiiii": code (200 SUCCESS, 400 FAIL), length, fmt, dtype, shape (4 ints),
location (always 0). Location is last here but fifth in a request.

    PUT     header + `length` bytes; no reply (the client never waits for one)
    GET     hit: SUCCESS with the PUT's length, fmt, dtype and shape, then the `length` bytes;
            miss: FAIL
    EXIST   SUCCESS or FAIL
    HEALTH  SUCCESS
    LIST    SUCCESS with length = n, then n bytes: the stored keys, UTF-8, joined by "\\n". LMCache
            0.5.6's server leaves LIST unanswered and its client never sends it; this is the
            reply its server's commented-out code sketches.
Replies without a memory object carry length 0, fmt 1, dtype 2 and shape 0,0,0,0, as LMCache's do.
As in LMCache's server, dtype 1 (half) comes back as 2 (float16): they are the same torch dtype.

Each value is stored as one chunk under "lmc:" + key: a 28-byte header (b"LMC1", fmt, dtype,
shape, little-endian) and the payload, received straight into that buffer (one copy). A request
that cannot be parsed (unknown command, format, dtype or location; a key that is not UTF-8 or is
empty; a length below 0 or above `max_value_bytes`) closes its connection with a warning, as
LMCache's server drops the connection when parsing fails; other connections are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Sequence
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from typing import cast

from llmesh.wire.errors import KVStoreFull

from .store import ChunkStore

log = logging.getLogger(__name__)

REQUEST = struct.Struct("=9i150s")  # command, length, fmt, dtype, location, shape x4, key
REPLY = struct.Struct("=9i")  # code, length, fmt, dtype, shape x4, location
STORED = struct.Struct("<4s6i")  # magic, fmt, dtype, shape x4; the payload follows
MAGIC = b"LMC1"
KEY_PREFIX = "lmc:"
PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5
SUCCESS, FAIL = 200, 400
DTYPE_REPLY = (0, 2, 2, 3, 4, 5, 6, 7, 8)  # request dtype code -> the code LMCache's server echoes
N_FORMATS = 10  # MemoryFormat 0..9 in LMCache 0.5.6
N_LOCATIONS = 3
DEFAULT_MAX_VALUE_BYTES = 1 << 30
LOOPBACK = (ip_network("127.0.0.1/32"), ip_network("::1/128"))
_EMPTY = (1, 2, 0, 0, 0, 0)  # fmt, dtype, shape of replies without a memory object


class _BadRequest(Exception):
    pass


class _Connection(asyncio.BufferedProtocol):
    def __init__(
        self,
        store: ChunkStore,
        lock: contextlib.AbstractContextManager,
        max_value_bytes: int,
        allow: Sequence[IPv4Network | IPv6Network],
    ):
        self.store, self.lock, self.max_value_bytes, self.allow = store, lock, max_value_bytes, allow
        self.header = bytearray(REQUEST.size)
        self.buf = memoryview(self.header)  # what is being received: a header or a PUT's value
        self.filled = 0
        self.put_key: str | None = None  # set while a PUT's payload is being received
        self.transport: asyncio.Transport  # from connection_made
        self.peer = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream server's (uvloop's: not a subclass)
        self.peer = transport.get_extra_info("peername")
        address = ip_address(self.peer[0]) if isinstance(self.peer, tuple) else None
        if address is None or not any(address in network for network in self.allow):
            log.warning(
                "lm:// refused a connection from %s: not in the allowed networks (MESH_LMCACHE_ALLOW)", self.peer
            )
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.filled or self.put_key is not None:
            log.warning("lm:// client %s closed mid-message (%d of %d bytes)", self.peer, self.filled, len(self.buf))

    def pause_writing(self) -> None:  # a client that does not read its GET replies stops being read
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled < len(self.buf):
            return
        self.filled = 0
        try:
            if self.put_key is None:
                self._request()
            else:
                self._store_put()
        except _BadRequest as exc:
            log.warning("lm:// client %s refused: %s", self.peer, exc)
            self._close()
        except Exception:
            log.exception("lm:// client %s: request failed", self.peer)
            self._close()

    def _close(self) -> None:
        self.filled, self.put_key = 0, None
        self.transport.close()

    def _request(self) -> None:
        command, length, fmt, dtype, location, *shape, raw_key = REQUEST.unpack(self.header)
        if not PUT <= command <= HEALTH:
            raise _BadRequest(f"unknown command {command}")
        if not (0 <= fmt < N_FORMATS and 0 <= dtype < len(DTYPE_REPLY) and 0 <= location < N_LOCATIONS):
            raise _BadRequest(f"bad fmt {fmt}, dtype {dtype} or location {location}")
        try:
            key = KEY_PREFIX + raw_key.decode().strip()
        except UnicodeDecodeError:
            raise _BadRequest("key is not UTF-8") from None
        if key == KEY_PREFIX:
            raise _BadRequest("empty key")
        if command == PUT:
            if not 0 <= length <= self.max_value_bytes:
                raise _BadRequest(f"PUT length {length} outside [0, {self.max_value_bytes}]")
            value = bytearray(STORED.size + length)
            STORED.pack_into(value, 0, MAGIC, fmt, DTYPE_REPLY[dtype], *shape)
            self.put_key, self.buf = key, memoryview(value)[STORED.size :]
            if length == 0:
                self._store_put()
        elif command == GET:
            self._get(key)
        elif command == EXIST:
            with self.lock:
                found = key in self.store
            self._reply(SUCCESS if found else FAIL)
        elif command == HEALTH:
            self._reply(SUCCESS)
        else:
            with self.lock:
                keys = [k[len(KEY_PREFIX) :] for k in self.store.keys() if k.startswith(KEY_PREFIX)]
            body = "\n".join(keys).encode()
            self._reply(SUCCESS, len(body))
            self.transport.write(body)

    def _store_put(self) -> None:
        key, value = self.put_key, self.buf.obj
        assert key is not None and isinstance(value, bytearray)  # a PUT's, made by _request
        self.put_key, self.buf = None, memoryview(self.header)
        try:
            with self.lock:
                self.store.put_many([(key, value)], pin_s=0.0)
        except KVStoreFull as exc:  # LMCache's PUT has no reply: the value is dropped, a later GET misses
            log.warning("lm:// PUT of %s (%d bytes) dropped: %s", key, len(value), exc)

    def _get(self, key: str) -> None:
        with self.lock:
            value = self.store.get(key)
        if value is None or len(value) < STORED.size or value[:4] != MAGIC:
            if value is not None:
                log.warning("lm:// GET of %s: stored value has no LMCache header; answering a miss", key)
            self._reply(FAIL)
            return
        _, fmt, dtype, *shape = STORED.unpack_from(value)
        length = len(value) - STORED.size
        self.transport.write(REPLY.pack(SUCCESS, length, fmt, dtype, *shape, 0))
        self.transport.write(memoryview(value)[STORED.size :])

    def _reply(self, code: int, length: int = 0) -> None:
        self.transport.write(REPLY.pack(code, length, *_EMPTY, 0))


async def start_lmcache_server(
    store: ChunkStore,
    host: str,
    port: int,
    *,
    lock: contextlib.AbstractContextManager | None = None,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    allow: Sequence[IPv4Network | IPv6Network] = LOOPBACK,
) -> asyncio.base_events.Server:
    """Serve LMCache's lm:// protocol on host:port (0: an ephemeral port; read it from `server.sockets`).

    `lock` guards every store access; pass the lock other threads hold while they touch the store.
    LMCache's protocol carries no credential, so only clients from the `allow`ed networks are served
    (others are cut off at once, and logged); its keys ("lmc:...") never name the mesh's own chunks.
    """
    lock = lock if lock is not None else contextlib.nullcontext()
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(store, lock, max_value_bytes, allow), host, port)


if __name__ == "__main__":  # a standalone endpoint over an in-memory store, for benchmarks and debugging
    import argparse

    parser = argparse.ArgumentParser(description="Serve LMCache's lm:// protocol over an in-memory ChunkStore.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=65432)
    parser.add_argument("--capacity-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def _main() -> None:
        server = await start_lmcache_server(ChunkStore(args.capacity_bytes), args.host, args.port)
        log.info("lm:// on %s", server.sockets[0].getsockname())
        await server.serve_forever()

    asyncio.run(_main())
