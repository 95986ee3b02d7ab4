"""The kv-store's direct data plane: framing and shared-memory segments.

NATS carries discovery and control; bulk KV bytes go over a direct TCP connection to the
shard (address announced over NATS). A frame is a fixed header (magic, metadata length,
payload length), msgpack metadata, then the raw payload, received with `recv_into` straight
into its final buffer.

When client and shard share a host, the client also offers a shared-memory segment (a file
under /dev/shm): a put's values are read from it and a get's values are written into it, so
each value crosses one memory copy instead of two socket copies. The shard attaching the
segment is the negotiation: if it cannot open the file (another host or container), the
connection stays on plain TCP.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from llmesh.wire.errors import BadMessage

MAGIC = b"LMKD"
VERSION = 1
HEADER = struct.Struct("<4sIQ")  # magic, metadata length, payload length
MAX_META_BYTES = 4 * 1024**2
SHM_DIR = Path("/dev/shm")
ALIGN = 64  # values in a shard's arena start on a cache line


def footprint(size: int) -> int:
    """Arena bytes a value of `size` bytes takes."""
    return -(-size // ALIGN) * ALIGN


IOV_MAX = 1024  # buffers one sendmsg takes (Linux's UIO_MAXIOV)


def send_frame(sock: socket.socket, meta: dict[str, Any], payload: Sequence[memoryview] = ()) -> None:
    body = msgpack.packb(meta)
    size = sum(len(p) for p in payload)
    parts = [memoryview(HEADER.pack(MAGIC, len(body), size) + body), *(memoryview(p).cast("B") for p in payload)]
    first = 0  # scatter-gather: the header and every value in as few system calls as the socket takes
    while first < len(parts):
        sent = sock.sendmsg(parts[first : first + IOV_MAX])
        while first < len(parts) and sent >= len(parts[first]):
            sent -= len(parts[first])
            first += 1
        if sent:
            parts[first] = parts[first][sent:]


def recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        view = view[n:]


def recv_header(sock: socket.socket, max_payload: int) -> tuple[dict[str, Any], int] | None:
    """The next frame's metadata and payload length; None if the peer closed cleanly."""
    head = bytearray(HEADER.size)
    first = sock.recv_into(head)
    if first == 0:
        return None
    recv_into(sock, memoryview(head)[first:])
    magic, meta_len, payload_len = HEADER.unpack(head)
    if magic != MAGIC:
        raise BadMessage(f"not a kv-store frame (magic {bytes(magic)!r})")
    if meta_len > MAX_META_BYTES:
        raise BadMessage(f"frame metadata of {meta_len} bytes exceeds {MAX_META_BYTES}")
    if payload_len > max_payload:
        raise BadMessage(f"frame payload of {payload_len} bytes exceeds {max_payload}")
    body = bytearray(meta_len)
    recv_into(sock, memoryview(body))
    try:
        meta = msgpack.unpackb(body)
    except Exception as exc:
        raise BadMessage(f"undecodable frame metadata: {exc}") from None
    if not isinstance(meta, dict):
        raise BadMessage("frame metadata is not a map")
    return meta, payload_len


def skip(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n:
        chunk = min(n, len(scratch))
        recv_into(sock, scratch[:chunk])
        n -= chunk


class ShmSegment:
    """A shared-memory file mapped into this process."""

    def __init__(self, name: str, size: int, *, create: bool, populate: bool = False):
        if "/" in name or name.startswith("."):
            raise BadMessage(f"bad shared-memory segment name {name!r}")
        self.name, self.size = name, size
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise BadMessage(f"shared-memory segment {name} is smaller than announced")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._map = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        return cls(f"llmesh-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}", size, create=True)

    def unlink(self) -> None:
        """Remove the name; the mapping lives on until both sides close it."""
        (SHM_DIR / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view: the mapping goes with it
            pass
