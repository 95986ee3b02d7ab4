"""The shard's direct data plane: a TCP server, one thread per connection (see llmesh.wire.kvwire).

Blocking `recv_into`/`sendall` release the GIL, so transfers on different connections run in
parallel with each other and with the shard's NATS loop; the store itself is touched only
under `ShardState.lock`, and values are immutable once stored, so they are sent outside it.

A connection first shows a token (`hello` {token}): the shard hands tokens out only over NATS, in
its announcements, which only NATS users allowed to read `mesh.kv.shards` (workers) receive
(llmesh.deploy.credentials); each lasts `TOKEN_TTL_S` and is signed with a key the shard made at start.
Anything else first, or a wrong or expired token, is refused and the connection closed.

Ops (metadata `op`): `put` {keys, sizes, pin_s, shm_offset?}, `get` {keys, pin_s, shm_offset?,
shm_capacity?} answered with {sizes} (-1: missing), `has` {keys} answered with {found}, `attach`
{name, size} (offer a shared-memory segment; answered with the shard's shared arena, if it has
one), and `grant` {size, min?}: space in that arena (`size` bytes if free, else at least `min`)
that the client lays its next puts' values out in, from the front, sending `put` {keys, sizes,
arena_offsets} to have them adopted as chunks without a copy. What is left of a grant returns to
the store with the next grant or when the connection closes. Errors answer {error: {code,
message}}; a frame that cannot be parsed, or whose payload was not consumed, also closes the
connection. Other connections are unaffected.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from llmesh.wire import telemetry
from llmesh.wire.errors import BadMessage, MeshError, Unauthenticated
from llmesh.wire.kvwire import ShmSegment, recv_header, recv_into, send_frame, skip

from .state import ShardState
from .store import Slab

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("llmesh.kv-store")


TOKEN_TTL_S = 60.0
HELLO_TIMEOUT_S = 10.0


class Tokens:
    """This shard's data-plane tokens: `<expiry>.<HMAC-SHA256 of shard and expiry>`."""

    def __init__(self, shard: str, ttl_s: float = TOKEN_TTL_S, clock: Callable[[], float] = time.time):
        self._key, self._shard, self._ttl_s, self._clock = secrets.token_bytes(32), shard, ttl_s, clock

    def _mac(self, expiry: str) -> str:
        return hmac.new(self._key, f"{self._shard}.{expiry}".encode(), hashlib.sha256).hexdigest()

    def mint(self, ttl_s: float | None = None) -> str:
        expiry = str(int(self._clock() + (self._ttl_s if ttl_s is None else ttl_s)))
        return f"{expiry}.{self._mac(expiry)}"

    def check(self, token: object) -> None:
        """Raise Unauthenticated unless `token` is one of ours and not expired."""
        expiry, _, mac = token.partition(".") if isinstance(token, str) else ("", "", "")
        if not (expiry.isdigit() and hmac.compare_digest(mac, self._mac(expiry))):
            raise Unauthenticated("not a data-plane token of this shard (take one from its announcement on NATS)")
        if int(expiry) < self._clock():
            raise Unauthenticated("the data-plane token has expired")


class _Connection:
    def __init__(self, state: ShardState, sock: socket.socket, max_value_bytes: int, tokens: Tokens):
        self.state, self.sock, self.max_value_bytes, self.tokens = state, sock, max_value_bytes, tokens
        self.shm: ShmSegment | None = None
        self.slab: Slab | None = None  # shared-arena space this client lays put values out in

    def serve(self) -> None:
        try:
            if self._admitted():
                while self._one_frame():
                    pass
        except (ConnectionError, OSError) as exc:
            log.debug("data connection closed: %s", exc)
        finally:
            if self.slab is not None:
                self.state.release_slab(self.slab)
            if self.shm is not None:
                self.shm.close()
            self.sock.close()

    def _admitted(self) -> bool:
        """Whether the first frame is a `hello` with a valid token (answered either way)."""
        peer = self._peer()
        self.sock.settimeout(HELLO_TIMEOUT_S)
        try:
            got = recv_header(self.sock, 0)
            if got is None:
                return False
            meta, _ = got
            if meta.get("op") != "hello":
                raise Unauthenticated(f"a connection starts with hello and a token, not {meta.get('op')!r}")
            self.tokens.check(meta.get("token"))
        except (BadMessage, Unauthenticated) as exc:
            log.warning("refused a data connection from %s: %s", peer, exc.message)
            self._send_error(exc if isinstance(exc, Unauthenticated) else Unauthenticated(exc.message))
            return False
        except TimeoutError:
            log.warning("refused a data connection from %s: no hello within %.0f s", peer, HELLO_TIMEOUT_S)
            return False
        self.sock.settimeout(None)
        send_frame(self.sock, {})
        return True

    def _peer(self) -> str:
        try:
            host, port = self.sock.getpeername()[:2]
            return f"{host}:{port}"
        except OSError:
            return "?"

    def _one_frame(self) -> bool:
        try:
            got = recv_header(self.sock, self.max_value_bytes)
        except BadMessage as exc:
            log.warning("closing a data connection: %s", exc)
            self._send_error(exc)
            return False
        if got is None:
            return False
        meta, payload_len = got
        handler = {
            "put": self._put,
            "get": self._get,
            "has": self._has,
            "attach": self._attach,
            "grant": self._grant,
        }.get(str(meta.get("op")))  # (str: an op of any other type is unknown, unhashable ones too)
        trace = meta.get("trace")
        span_cm = (
            _tracer.start_as_current_span(f"kv-store {meta.get('op')}", context=telemetry.extract(trace))
            if isinstance(trace, dict)
            else contextlib.nullcontext()
        )
        with span_cm:
            try:
                if handler is None:
                    raise BadMessage(f"unknown data-plane op {meta.get('op')!r}")
                handler(meta, payload_len)  # answers itself
            except MeshError as exc:  # raised before any of the payload was read
                skip(self.sock, payload_len)
                self._send_error(exc)
        return True

    def _send_error(self, exc: MeshError) -> None:
        try:
            send_frame(self.sock, _error(exc))
        except OSError:
            pass

    def _put(self, meta: dict[str, Any], payload_len: int) -> None:
        keys, sizes = _keys(meta), _sizes(meta)
        total = sum(sizes)
        arena_offsets = meta.get("arena_offsets")
        if arena_offsets is not None:  # written in place into our arena: adopt them, nothing to copy
            if (
                self.slab is None
                or payload_len
                or not isinstance(arena_offsets, list)
                or len(arena_offsets) != len(keys)
            ):
                raise BadMessage("put: arena_offsets need granted space and one offset per key")
            self.state.adopt(self.slab, keys, sizes, arena_offsets, float(meta.get("pin_s") or 0.0))
            send_frame(self.sock, {})
            return
        offset = meta.get("shm_offset")
        if offset is None:
            if payload_len != total:
                raise BadMessage(f"put: payload of {payload_len} bytes but sizes sum to {total}")
        elif (
            self.shm is None
            or payload_len
            or not isinstance(offset, int)
            or offset < 0
            or offset + total > self.shm.size
        ):
            raise BadMessage("put: shm_offset without an attached segment large enough")
        try:
            res = self.state.reserve(keys, sizes, float(meta.get("pin_s") or 0.0))
        except MeshError as exc:  # e.g. the store is full of pinned chunks: drop the payload
            skip(self.sock, payload_len)
            send_frame(self.sock, _error(exc))
            return
        try:
            pos = offset or 0
            for view in res.views:
                if offset is None:
                    recv_into(self.sock, view)
                else:
                    assert self.shm is not None  # checked with the offset
                    view[:] = self.shm.view[pos : pos + len(view)]
                    pos += len(view)
        except BaseException:
            self.state.abort(res)
            raise
        self.state.commit(res)
        send_frame(self.sock, {})

    def _get(self, meta: dict[str, Any], payload_len: int) -> None:
        if payload_len:
            raise BadMessage("get: carries no payload")
        read = self.state.get_many(_keys(meta), float(meta.get("pin_s") or 0.0))
        try:  # answered while the chunks are held
            self._answer_get(meta, read.values)
        finally:
            self.state.release(read)

    def _answer_get(self, meta: dict[str, Any], values: list[memoryview | None]) -> None:
        sizes = [-1 if v is None else len(v) for v in values]
        found = [v for v in values if v is not None]
        total = sum(len(v) for v in found)
        offset, capacity = meta.get("shm_offset"), meta.get("shm_capacity") or 0
        if (
            self.shm is not None
            and isinstance(offset, int)
            and offset >= 0
            and total <= min(capacity, self.shm.size - offset)
        ):
            pos = offset
            for value in found:
                self.shm.view[pos : pos + len(value)] = value
                pos += len(value)
            send_frame(self.sock, {"sizes": sizes, "shm": True})
        else:
            send_frame(self.sock, {"sizes": sizes}, found)

    def _grant(self, meta: dict[str, Any], payload_len: int) -> None:
        """Space in the shared arena for this client's next puts (what is left of the last grant
        is given back): `size` bytes if they are free, else at least `min`, evicting for them."""
        size, least = meta.get("size"), meta.get("min", meta.get("size"))
        if (
            payload_len
            or self.shm is None
            or self.state.store.arena.name is None
            or not isinstance(size, int)
            or not isinstance(least, int)
            or not 0 < least <= size
        ):
            raise BadMessage("grant: needs a size (and a min up to it), and an attached client on the shard's host")
        if self.slab is not None:
            self.state.release_slab(self.slab)
            self.slab = None
        try:
            self.slab = self.state.grant(size, least)
        except MeshError as exc:
            send_frame(self.sock, _error(exc))
            return
        send_frame(self.sock, {"offset": self.slab.offset, "size": self.slab.end - self.slab.offset})

    def _has(self, meta: dict[str, Any], payload_len: int) -> None:
        if payload_len:
            raise BadMessage("has: carries no payload")
        send_frame(self.sock, {"found": self.state.contains(_keys(meta))})

    def _attach(self, meta: dict[str, Any], payload_len: int) -> None:
        name, size = meta.get("name"), meta.get("size")
        if payload_len or not isinstance(name, str) or not isinstance(size, int) or size <= 0:
            raise BadMessage("attach: needs a segment name and size")
        try:
            segment = ShmSegment(name, size, create=False)
        except (OSError, BadMessage) as exc:
            send_frame(self.sock, {"shm": False, "reason": str(exc)})
            return
        if self.shm is not None:
            self.shm.close()
        self.shm = segment
        arena = self.state.store.arena
        send_frame(
            self.sock, {"shm": True, "arena": arena.name, "arena_size": arena.capacity} if arena.name else {"shm": True}
        )


def _error(exc: MeshError) -> dict[str, Any]:
    return {"error": {"code": exc.code, "message": exc.message}}


def _sizes(meta: dict[str, Any]) -> list[int]:
    sizes, keys = meta.get("sizes"), meta.get("keys")
    if (
        not isinstance(sizes, list)
        or not isinstance(keys, list)
        or len(sizes) != len(keys)
        or any(not isinstance(s, int) or s < 0 for s in sizes)
    ):
        raise BadMessage("sizes must be one non-negative int per key")
    return sizes


def _keys(meta: dict[str, Any]) -> list[str]:
    keys = meta.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise BadMessage("keys must be a list of strings")
    return keys


class DataPlaneServer:
    def __init__(self, state: ShardState, host: str, port: int, max_value_bytes: int, tokens: Tokens):
        self.state, self.max_value_bytes, self.tokens = state, max_value_bytes, tokens
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept_loop, name="kv-data-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self.state, sock, self.max_value_bytes, self.tokens)
            threading.Thread(target=conn.serve, name="kv-data", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
