"""Client of the kv-store: shard discovery over NATS, bulk bytes over the direct data plane.

- `ShardDirectory` follows the shards' announcements (NATS) and maps each key to its shard
  by rendezvous hashing, so adding a shard moves only the keys it now wins. A key missing
  on its owner is looked up in the shards' chunk index in Redis (`ChunkLocator`), so chunks
  stored before the shards changed are still found where they are.
- `KvClient` is synchronous and thread-safe: each shard has a pool of direct connections,
  each with its own shared-memory segment when the shard is on this host (see llmesh.wire.kvwire).
- `ThreadedKvClient` runs the directory on a private event-loop thread and the transfers on
  a thread pool, returning futures: for synchronous callers such as the vLLM connector.

A get's values may be views into a connection's shared-memory segment: they stay valid
until `Fetched.release()` (or leaving its `with` block), which returns the connection.

Transfer buffers come from a `HostBuffers`: plain memory by default; on a GPU host the connector's
(`llmesh.engine.kv_mover.HostMemory`): TCP buffers from a pinned pool, and every shared-memory mapping (the
shard's arena, a connection's segment) registered with CUDA once, so the device copies straight into
and out of the store's memory at pinned speed. Puts and gets also say which contiguous host memory
holds which of their values (`Staged.runs`, `Fetched.runs`), so a device copies a run at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from llmesh.wire import telemetry
from llmesh.wire.bus import Bus, Handler
from llmesh.wire.errors import BadMessage, MeshError, ServiceUnavailable, Timeout, from_code
from llmesh.wire.kvkeys import INDEX_KEY, block_chunk_keys, decode_entry
from llmesh.wire.kvwire import ShmSegment, footprint, recv_header, recv_into, send_frame, skip
from llmesh.wire.messages import KvDiscover, KvShardInfo, Subjects, decode
from llmesh.wire.secrets import redacted

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")
SHM_MIN_BYTES = 16 * 1024**2  # smallest segment; grown to the largest transfer seen
SLAB_BYTES = 8 * 1024**2  # arena space asked for at a time (at most 1/64 of the arena)
MAX_REPLY_BYTES = 1 << 40
# Shards announce themselves every second and answer a discover at once: a client that has heard
# none this long after it started treats the store as absent (callers compute instead of loading)
# rather than holding each request for its whole timeout.
DISCOVERY_WAIT_S = 3.0


Run = tuple[list[int], memoryview]  # positions of values (in a put's or get's keys), the host bytes holding them


class Buffers(Protocol):
    """Where transfer buffers come from: `HostBuffers`, or on a GPU host `llmesh.engine.kv_mover.HostMemory`."""

    def take(self, size: int) -> memoryview: ...

    def give(self, view: memoryview) -> None: ...

    def register(self, view: memoryview) -> None: ...

    def unregister(self, view: memoryview) -> None: ...


class HostBuffers:
    """Where transfer buffers come from: plain memory, and nothing to register (see the module's docstring)."""

    def take(self, size: int) -> memoryview:
        return memoryview(bytearray(size))

    def give(self, view: memoryview) -> None:
        """`view`, from `take`, is no longer used."""

    def register(self, view: memoryview) -> None:
        """A shared-memory mapping that copies go to and from, until `unregister` (before it is closed)."""

    def unregister(self, view: memoryview) -> None:
        pass


PLAIN = HostBuffers()


def rendezvous_owner(key: str, shards: Sequence[str]) -> str:
    """The shard with the highest hash of (shard, key): stable when other shards come and go."""
    return max(shards, key=lambda s: hashlib.blake2b(f"{s}\0{key}".encode(), digest_size=8).digest())


class ShardDirectory:
    """Live kv-store shards, from their announcements; an entry expires after 3 missed beats."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self._shards: dict[str, tuple[KvShardInfo, float]] = {}
        self._known = threading.Event()
        self._started = time.monotonic()

    async def start(self) -> None:
        await self.bus.nc.subscribe(Subjects.KV_SHARDS, cb=self._on_announce)
        await self.bus.publish(Subjects.KV_DISCOVER, KvDiscover())

    async def _on_announce(self, msg: Any) -> None:
        try:
            info, _ = decode(msg.data, KvShardInfo)
        except MeshError as exc:
            log.warning("ignoring a bad shard announcement: %s", exc)
            return
        if info.shard not in self._shards:
            log.info("kv-store shard %s at %s:%d", info.shard, info.data_host, info.data_port)
        self._shards[info.shard] = (info, time.monotonic())
        self._known.set()

    def live(self, wait_s: float = 0.0) -> dict[str, KvShardInfo]:
        """The shards heard from lately; until a first one is heard, waits for it until `wait_s`
        after this directory was made (not `wait_s` per call: a store that never came costs each
        call nothing)."""
        if wait_s and not self._known.is_set():
            self._known.wait(max(0.0, self._started + wait_s - time.monotonic()))
        now = time.monotonic()
        return {s: info for s, (info, seen) in list(self._shards.items()) if now - seen < 3 * info.heartbeat_s}

    def token(self, shard: str) -> str:
        """The data-plane token of `shard`'s latest announcement."""
        entry = self._shards.get(shard)
        return entry[0].token if entry else ""


class ChunkLocator:
    """Reads the shards' chunk index in Redis: where a chunk is when it is not on its owner
    (it was stored before the shards changed). Redis being away just means no answer."""

    def __init__(self, url: str, timeout_s: float = 0.5):
        import redis

        self.url = redacted(url)  # for logs
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._failing = False

    def locate(self, keys: Sequence[str]) -> dict[str, str]:
        """The shard each key is recorded on; keys not in the index are left out."""
        import redis

        try:
            values = self._redis.hmget(INDEX_KEY, list(keys))
        except (redis.exceptions.RedisError, OSError) as exc:
            if not self._failing:
                log.warning("chunk index at %s unreachable (%s): only owners are asked", self.url, exc)
            self._failing = True
            return {}
        self._failing = False
        return {k: decode_entry(v)[0] for k, v in zip(keys, values) if v is not None}


_arenas: dict[str, ShmSegment] = {}  # shards' shared arenas, mapped once per process
_arenas_lock = threading.Lock()


def _map_arena(name: str, size: int, host: Buffers) -> ShmSegment:
    with _arenas_lock:
        arena = _arenas.get(name)
        if arena is None or arena.size != size:
            arena = _arenas[name] = ShmSegment(name, size, create=False, populate=True)
    host.register(arena.view)  # (once per mapping)
    return arena


class DirectConnection:
    """One blocking connection to a shard's data plane; not thread-safe (pools hand it out)."""

    def __init__(self, host: str, port: int, *, token: str, timeout: float, use_shm: bool, buffers: Buffers = PLAIN):
        """Connect and show `token` (from the shard's announcement: llmesh_kvstore.dataplane)."""
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ServiceUnavailable(f"cannot reach kv-store data plane at {host}:{port}: {exc}") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.address = f"{host}:{port}"
        self.shm: ShmSegment | None = None
        self._use_shm = use_shm
        self.broken = False
        self._staged: tuple[Any, Any] | None = None  # ("arena", offsets) or (buffer, in our segment)
        self.arena: ShmSegment | None = None  # the shard's shared arena, mapped here
        self._slab = (0, 0)  # the part of it granted to this connection and not yet used: [start, end)
        self.reused = False  # handed out again by its pool (the shard may have restarted since)
        self._buffers = buffers
        try:
            self._call({"op": "hello", "token": token})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.sock.close()
        self._drop_segment()
        self._give_staged()

    def _drop_segment(self) -> None:
        if self.shm is not None:
            self._buffers.unregister(self.shm.view)
            self.shm.close()
            self.shm = None

    def _give_staged(self) -> None:
        """A private buffer staged for a put that will not be sent goes back to the buffers."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] != "arena" and not staged[1]:
            self._buffers.give(staged[0])

    def _call(self, meta: dict[str, Any], payload: Sequence[memoryview] = ()) -> tuple[dict[str, Any], int]:
        trace = telemetry.inject()
        if trace:
            meta["trace"] = trace
        try:
            send_frame(self.sock, meta, payload)
            got = recv_header(self.sock, MAX_REPLY_BYTES)
            if got is None:
                raise ConnectionError("the shard closed the connection")
        except TimeoutError as exc:
            self.broken = True
            raise Timeout(f"kv-store {self.address} did not answer in time") from exc
        except (OSError, BadMessage) as exc:
            self.broken = True
            raise ServiceUnavailable(f"kv-store {self.address}: {exc}") from exc
        reply, payload_len = got
        if "error" in reply:
            skip(self.sock, payload_len)
            err = reply["error"]
            raise from_code(err.get("code", ""), f"kv-store {self.address}: {err.get('message', '')}")
        return reply, payload_len

    def _segment(self, size: int) -> ShmSegment | None:
        """A segment of at least `size` bytes attached by the shard, or None (plain TCP)."""
        if not self._use_shm:
            return None
        if self.shm is not None and self.shm.size >= size:
            return self.shm
        try:
            segment = ShmSegment.create(max(SHM_MIN_BYTES, 1 << (size - 1).bit_length()))
        except OSError as exc:
            log.info("no shared memory here (%s): plain TCP to %s", exc, self.address)
            self._use_shm = False
            return None
        try:
            reply, _ = self._call({"op": "attach", "name": segment.name, "size": segment.size})
        finally:
            segment.unlink()  # both sides have it mapped (or not): no name can leak
        if not reply.get("shm"):
            log.info("kv-store %s cannot attach our shared memory (%s): plain TCP", self.address, reply.get("reason"))
            segment.close()
            self._use_shm = False
            return None
        self._drop_segment()
        self.shm = segment
        self._buffers.register(segment.view)
        if reply.get("arena") and self.arena is None:
            try:
                self.arena = _map_arena(reply["arena"], int(reply["arena_size"]), self._buffers)
            except (OSError, BadMessage, ValueError) as exc:
                log.info("cannot map kv-store %s's arena (%s): the shard copies puts", self.address, exc)
        return segment

    def put(self, keys: Sequence[str], values: Sequence[Buffer], pin_s: float) -> None:
        views = [memoryview(v).cast("B") for v in values]
        sizes = [len(v) for v in views]
        if self._segment(sum(sizes)) is None:  # plain TCP: send the caller's buffers as they are
            self._call({"op": "put", "keys": list(keys), "sizes": sizes, "pin_s": pin_s}, views)
            return
        for staged, value in zip(self.staging(sizes)[0], views):
            staged[:] = value
        self.put_staged(keys, sizes, pin_s)

    def staging(self, sizes: Sequence[int]) -> tuple[list[memoryview], memoryview | None]:
        """Buffers to write the next put's values into, and one view of them all when they are
        contiguous. Best: space the shard granted us in its shared arena (the values become chunks
        where they are); else our own segment (the shard copies from it); else a private buffer
        (from the host buffers) sent over TCP."""
        self._give_staged()
        total = sum(sizes)
        segment = self._segment(max(total, 1))
        if segment is not None and self.arena is not None:
            needed = sum(footprint(size) for size in sizes)
            pos = self._slab[0] if self._slab[0] + needed <= self._slab[1] else self._grant(needed)
            offsets = []
            for size in sizes:
                offsets.append(pos)
                pos += footprint(size)
            self._staged = ("arena", offsets)
            dense = all(footprint(size) == size for size in sizes[:-1])
            run = self.arena.view[offsets[0] : offsets[-1] + sizes[-1]] if dense and sizes else None
            return [self.arena.view[o : o + n] for o, n in zip(offsets, sizes)], run
        buffer = segment.view[:total] if segment is not None else self._buffers.take(total)
        self._staged = (buffer, segment is not None)
        out, pos = [], 0
        for size in sizes:
            out.append(buffer[pos : pos + size])
            pos += size
        return out, buffer

    def _grant(self, needed: int) -> int:
        """New space in the shard's arena for at least `needed` bytes (more, up to a slab, where the
        shard has it without evicting); returns where it starts."""
        assert self.arena is not None
        self._slab = (0, 0)  # the shard gives back what is left of the last grant, whether this one succeeds or not
        reply, _ = self._call(
            {"op": "grant", "size": max(needed, min(SLAB_BYTES, self.arena.size // 64)), "min": needed}
        )
        offset, size = reply.get("offset"), reply.get("size")
        if (
            not isinstance(offset, int)
            or not isinstance(size, int)
            or offset < 0
            or size < needed
            or offset + size > self.arena.size
        ):
            self.broken = True
            raise BadMessage(f"kv-store {self.address} granted {size!r} bytes at {offset!r}")
        self._slab = (offset, offset + size)
        return offset

    def put_staged(self, keys: Sequence[str], sizes: Sequence[int], pin_s: float) -> None:
        """Store the values written into the buffers of the last `staging` call."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise BadMessage("put_staged without staging")
        meta = {"op": "put", "keys": list(keys), "sizes": list(sizes), "pin_s": pin_s}
        if staged[0] == "arena":
            offsets = staged[1]
            self._call({**meta, "arena_offsets": offsets})
            if offsets:
                self._slab = (offsets[-1] + footprint(sizes[-1]), self._slab[1])
            return
        buffer, in_shm = staged
        if in_shm:
            self._call({**meta, "shm_offset": 0})
            return
        try:
            self._call(meta, [buffer])
        finally:
            self._buffers.give(buffer)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        reply, _ = self._call({"op": "has", "keys": list(keys)})
        found = reply.get("found")
        if not isinstance(found, list) or len(found) != len(keys):
            self.broken = True
            raise BadMessage(f"kv-store {self.address} answered `has` with {found!r}")
        return [bool(f) for f in found]

    def get(self, keys: Sequence[str], pin_s: float) -> tuple[list[memoryview | None], bool, memoryview]:
        """Values (views), whether they live in our segment (valid until the next call), and the buffer
        holding them all, in order: else it is from the host buffers (`give` it back when done)."""
        segment = self.shm if self._use_shm else None
        meta: dict[str, Any] = {"op": "get", "keys": list(keys), "pin_s": pin_s}
        if segment is not None:
            meta.update(shm_offset=0, shm_capacity=segment.size)
        reply, payload_len = self._call(meta)
        sizes = reply.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != len(keys):
            self.broken = True
            raise BadMessage(f"kv-store {self.address} answered a get with {sizes!r} sizes")
        in_shm = bool(reply.get("shm"))
        if in_shm:
            assert segment is not None  # asked for only with one
            buffer = segment.view
        else:
            buffer = self._buffers.take(payload_len)
            try:
                recv_into(self.sock, buffer)
            except OSError as exc:
                self._buffers.give(buffer)
                self.broken = True
                raise ServiceUnavailable(f"kv-store {self.address}: {exc}") from exc
            if self._use_shm and payload_len:
                self._segment(payload_len)  # large enough for next time
        out, pos = [], 0
        for size in sizes:
            out.append(None if size < 0 else buffer[pos : pos + size])
            pos += max(size, 0)
        if pos > len(buffer):
            if not in_shm:
                self._buffers.give(buffer)
            self.broken = True
            raise BadMessage(f"kv-store {self.address} sizes exceed its answer")
        return out, in_shm, buffer[:pos]


class _Pool:
    def __init__(
        self,
        info: KvShardInfo,
        token: Callable[[], str],
        *,
        size: int,
        timeout: float,
        use_shm: bool,
        buffers: Buffers,
    ):
        self.info, self._token, self._timeout, self._use_shm = info, token, timeout, use_shm
        self._buffers = buffers
        self._idle: queue.LifoQueue[DirectConnection] = queue.LifoQueue()
        self._slots = threading.Semaphore(size)

    def acquire(self, fresh: bool = False) -> DirectConnection:
        if not self._slots.acquire(timeout=self._timeout):
            raise Timeout(f"no free connection to kv-store shard {self.info.shard}")
        if not fresh:
            try:
                conn = self._idle.get_nowait()
                conn.reused = True
                return conn
            except queue.Empty:
                pass
        try:
            return DirectConnection(
                self.info.data_host,
                self.info.data_port,
                token=self._token(),
                timeout=self._timeout,
                use_shm=self._use_shm,
                buffers=self._buffers,
            )
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: DirectConnection) -> None:
        if conn.broken:
            conn.close()
        else:
            self._idle.put(conn)
        self._slots.release()

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().close()


class Fetched(Sequence):
    """A get's values in key order (None: missing), and `runs`, the contiguous buffers holding them;
    views valid until `release()`."""

    def __init__(
        self,
        values: list[memoryview | None],
        held: list[tuple[_Pool, DirectConnection]],
        runs: list[Run] | None = None,
        taken: list[memoryview] | None = None,
        buffers: Buffers = PLAIN,
    ):
        self._values, self._held = values, held
        self.runs = runs or []
        self._taken, self._buffers = taken or [], buffers

    def __getitem__(self, i):
        return self._values[i]

    def __len__(self) -> int:
        return len(self._values)

    def release(self) -> None:
        held, self._held = self._held, []
        for pool, conn in held:
            pool.release(conn)
        taken, self._taken = self._taken, []
        for buffer in taken:
            self._buffers.give(buffer)

    def __enter__(self) -> Fetched:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class KvClient:
    """Synchronous, thread-safe puts and gets across the live shards."""

    def __init__(
        self,
        directory: ShardDirectory,
        *,
        timeout: float = 30.0,
        use_shm: bool = True,
        connections_per_shard: int = 8,
        locator: ChunkLocator | None = None,
        buffers: Buffers = PLAIN,
    ):
        self.directory, self.timeout, self.use_shm, self.locator = directory, timeout, use_shm, locator
        self.buffers = buffers
        self._connections_per_shard = connections_per_shard
        self._pools: dict[tuple[str, str, int], _Pool] = {}
        self._lock = threading.Lock()

    def _by_shard(self, keys: Sequence[str]) -> dict[_Pool, list[int]]:
        """Indices of `keys` grouped by the pool of their owner shard."""
        live = self.directory.live(wait_s=min(self.timeout, DISCOVERY_WAIT_S))
        if not live:
            raise ServiceUnavailable("no kv-store shard is announcing itself")
        names = sorted(live)
        groups: dict[_Pool, list[int]] = {}
        for i in range(len(keys)):
            groups.setdefault(self._pool(live[rendezvous_owner(keys[i], names)]), []).append(i)
        return groups

    def _elsewhere(self, keys: Sequence[str], missing: list[int]) -> dict[_Pool, list[int]]:
        """Indices of missing keys that the chunk index places on another live shard."""
        if not missing or self.locator is None:
            return {}
        live = self.directory.live()
        where = self.locator.locate([keys[i] for i in missing])
        groups: dict[_Pool, list[int]] = {}
        for i in missing:
            shard = where.get(keys[i])
            if shard in live and shard != rendezvous_owner(keys[i], sorted(live)):
                groups.setdefault(self._pool(live[shard]), []).append(i)
        return groups

    def _pool(self, info: KvShardInfo) -> _Pool:
        ident = (info.shard, info.data_host, info.data_port)
        with self._lock:
            pool = self._pools.get(ident)
            if pool is None:
                pool = self._pools[ident] = _Pool(
                    info,
                    lambda: self.directory.token(info.shard),
                    size=self._connections_per_shard,
                    timeout=self.timeout,
                    use_shm=self.use_shm,
                    buffers=self.buffers,
                )
            return pool

    @staticmethod
    def _run(pool: _Pool, fn: Callable[[DirectConnection], T]) -> tuple[DirectConnection, T]:
        """`fn` on a pooled connection, which the caller releases. A reused connection that the
        shard has closed since (it restarted) is replaced once: puts and gets are idempotent."""
        for attempt in (0, 1):
            conn = pool.acquire(fresh=attempt > 0)
            try:
                return conn, fn(conn)
            except ServiceUnavailable:
                pool.release(conn)
                if attempt or not (conn.reused and conn.broken):
                    raise
            except BaseException:
                pool.release(conn)
                raise
        raise AssertionError("unreachable")

    def put(self, keys: Sequence[str], values: Sequence[Buffer], *, pin_s: float = 0.0) -> None:
        if len(keys) != len(values):
            raise BadMessage("put needs one value per key")
        for pool, idx in self._by_shard(keys).items():
            conn, _ = self._run(pool, lambda c: c.put([keys[i] for i in idx], [values[i] for i in idx], pin_s))
            pool.release(conn)

    @contextlib.contextmanager
    def staged_put(self, keys: Sequence[str], sizes: Sequence[int], *, pin_s: float = 0.0) -> Iterator[Staged]:
        """Writable buffers, one per key, that are stored on leaving the block: a producer writes
        its values straight into the memory they are sent from (on this host, memory shared with
        the shard, so a put costs one copy in all)."""
        views = Staged([memoryview(b"")] * len(keys))
        held: list[tuple[_Pool, DirectConnection, list[int]]] = []
        try:
            for pool, idx in self._by_shard(keys).items():
                conn, (staged, run) = self._run(pool, lambda c: c.staging([sizes[i] for i in idx]))
                held.append((pool, conn, idx))
                for i, view in zip(idx, staged):
                    views[i] = view
                views.runs += [(idx, run)] if run is not None else [([i], view) for i, view in zip(idx, staged)]
            try:
                yield views
            except BaseException:
                for _, conn, _ in held:  # closing it drops anything reserved for it
                    conn.broken = True
                raise
            for pool, conn, idx in held:
                sub_keys, sub_sizes = [keys[i] for i in idx], [sizes[i] for i in idx]
                try:
                    conn.put_staged(sub_keys, sub_sizes, pin_s)
                except ServiceUnavailable:
                    if not (conn.reused and conn.broken):
                        raise
                    fresh, _ = self._run(pool, lambda c: c.put(sub_keys, [views[i] for i in idx], pin_s))
                    pool.release(fresh)  # (the shard restarted since `conn` was last used: sent again)
        finally:
            for pool, conn, _ in held:
                pool.release(conn)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held (in any tier), without reading it."""
        found = [False] * len(keys)
        for pool, idx in self._owners_then_elsewhere(keys, lambda: [i for i, f in enumerate(found) if not f]):
            conn, got = self._run(pool, lambda c: c.contains([keys[i] for i in idx]))
            pool.release(conn)
            for i, f in zip(idx, got):
                found[i] = f
        return found

    def stored_blocks(self, block_hashes: Sequence[str], layout: dict[str, Any]) -> list[bool]:
        """Whether the store holds each of `block_hashes` whole: every layer, every head group."""
        if not block_hashes:
            return []
        found = self.contains([key for h in block_hashes for key in block_chunk_keys(h, layout)])
        per_block = len(found) // len(block_hashes)
        return [all(found[i : i + per_block]) for i in range(0, len(found), per_block)]

    def stored_run(self, block_hashes: Sequence[str], layout: dict[str, Any]) -> int:
        """How many of `block_hashes`, from the first, the store holds whole."""
        return leading_run(self.stored_blocks(block_hashes, layout))

    def get(self, keys: Sequence[str], *, pin_s: float = 0.0) -> Fetched:
        values: list[memoryview | None] = [None] * len(keys)
        fetched = Fetched(values, [], buffers=self.buffers)
        try:
            for pool, idx in self._owners_then_elsewhere(keys, lambda: [i for i, v in enumerate(values) if v is None]):
                conn, (got, in_shm, buffer) = self._run(pool, lambda c: c.get([keys[i] for i in idx], pin_s))
                if in_shm:  # the values live in the connection's segment until released
                    fetched._held.append((pool, conn))
                else:
                    fetched._taken.append(buffer)
                    pool.release(conn)
                for i, v in zip(idx, got):
                    values[i] = v
                present = [i for i, v in zip(idx, got) if v is not None]
                if present:
                    fetched.runs.append((present, buffer))
        except BaseException:
            fetched.release()
            raise
        return fetched

    def _owners_then_elsewhere(
        self, keys: Sequence[str], missing: Callable[[], list[int]]
    ) -> Iterator[tuple[_Pool, list[int]]]:
        """(pool, key indices) to ask: each key's owner first, then, for the keys still `missing()`,
        the shard the chunk index places them on."""
        yield from self._by_shard(keys).items()
        yield from self._elsewhere(keys, missing()).items()

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()


class Staged(list):
    """A staged put's buffers, one per key, and `runs`: which contiguous memory holds which of them."""

    runs: list[Run]

    def __init__(self, views: list[memoryview]):
        super().__init__(views)
        self.runs = []


def leading_run(held: Sequence[bool]) -> int:
    """How many of `held`, from the first, are true."""
    return next((i for i, h in enumerate(held) if not h), len(held))


class FillGuard:
    """Lets whoever owns the data a transfer thread is to copy take it back: once `revoke()` returns,
    the copy has been made or never will be (the put then fails). A caller that gives up waiting for
    a put must revoke before its data changes, or the store could keep what the memory held later
    under the keys of what it held before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._revoked = False

    def guarded(self, fill: Callable[[list[memoryview]], None]) -> Callable[[list[memoryview]], None]:
        def run(views: list[memoryview]) -> None:
            with self._lock:
                if self._revoked:
                    raise Timeout("the data to store was taken back before it was copied")
                fill(views)

        return run

    def revoke(self) -> None:
        with self._lock:  # waits out a copy under way
            self._revoked = True


class ThreadedKvClient:
    """A KvClient with its directory on a private event-loop thread; transfers run on a thread
    pool and return futures (for synchronous code: the vLLM connector)."""

    def __init__(
        self,
        nats_url: str,
        name: str,
        *,
        threads: int = 8,
        redis_url: str = "",
        timeout: float = 30.0,
        buffers: Buffers = PLAIN,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-kv", daemon=True)
        self._thread.start()
        self._bus = asyncio.run_coroutine_threadsafe(Bus.connect(nats_url, name), self._loop).result()
        directory = ShardDirectory(self._bus)
        asyncio.run_coroutine_threadsafe(directory.start(), self._loop).result()
        self.client = KvClient(
            directory,
            timeout=timeout,
            connections_per_shard=threads,
            locator=ChunkLocator(redis_url) if redis_url else None,
            buffers=buffers,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-kv")

    def serve(self, subject: str, handler: Handler) -> None:
        """Answer `subject` on this client's bus; `handler` runs on its event-loop thread."""
        asyncio.run_coroutine_threadsafe(self._bus.serve(subject, handler, traced=False), self._loop).result(timeout=10)

    def put(
        self, keys: Sequence[str], values: Sequence[Buffer], *, pin_s: float, trace_context=None
    ) -> concurrent.futures.Future:
        return self._pool.submit(
            self._traced, "kv.put", trace_context, len(keys), self.client.put, keys, values, pin_s=pin_s
        )

    def put_filled(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        fill: Callable[[Staged], None],
        *,
        pin_s: float,
        trace_context=None,
    ) -> concurrent.futures.Future:
        """Store values that `fill` writes, in the transfer thread, into the buffers they are sent
        from (see `KvClient.staged_put`): the caller's data must not change until the future is done."""
        return self._pool.submit(
            self._traced, "kv.put", trace_context, len(keys), self._fill_and_put, keys, sizes, fill, pin_s
        )

    def _fill_and_put(
        self, keys: Sequence[str], sizes: Sequence[int], fill: Callable[[Staged], None], pin_s: float
    ) -> None:
        with self.client.staged_put(keys, sizes, pin_s=pin_s) as views:
            fill(views)

    def get(
        self, keys: Sequence[str], consume: Callable[[Fetched], T], *, trace_context=None
    ) -> concurrent.futures.Future[T]:
        """Fetch `keys` and run `consume` on the values in the transfer thread; the future holds
        its result. The values are released afterwards, so `consume` must copy what it keeps."""
        return self._pool.submit(self._traced, "kv.get", trace_context, len(keys), self._get_and_consume, keys, consume)

    def _get_and_consume(self, keys: Sequence[str], consume: Callable[[Fetched], T]) -> T:
        with self.client.get(keys) as values:
            return consume(values)

    @staticmethod
    def _traced(name: str, ctx, chunks: int, fn, *args, **kwargs):
        with telemetry.tracer("llmesh.engine.kvclient").start_as_current_span(name, context=ctx) as span:
            span.set_attribute("kv.chunks", chunks)
            return fn(*args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
        asyncio.run_coroutine_threadsafe(self._bus.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
