"""The SSD tier: one file per chunk under a data directory, crash-safe and checksummed.

A file is a fixed header (magic, version, key length, data length, CRC-32 of key and data),
the key, then the data. It is written to a temporary name, fsynced, and renamed into place
(and the directory fsynced), so a crash leaves either the old state or the whole new file.
On start the directory is indexed again from the headers alone; temporary files and files
with a bad header are removed. A read verifies the checksum; a corrupt file is a clean miss.
Any OS error on write (disk full, directory unwritable) disables the tier with an error log:
the memory tier goes on alone and nothing already stored is lost.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"LMKV"
VERSION = 1
HEADER = struct.Struct(">4sBHQI")  # magic, version, key length, data length, crc32(key + data)


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class SsdTier:
    """Thread-safe: the shard's cleaner writes chunks here while requests read."""

    def __init__(self, directory: Path, capacity_bytes: int):
        self._lock = threading.RLock()
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> data size, least recent first
        self._bytes = 0
        self.enabled = capacity_bytes > 0
        self.reads = self.writes = self.evictions = self.corrupt = 0
        if self.enabled:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._reindex()
            except OSError as exc:
                self._disable(f"cannot use {self.directory}: {exc}")

    # ---- public ------------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        return self._bytes

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @_locked
    def keys(self) -> list[str]:
        return list(self._index)

    def size_of(self, key: str) -> int | None:
        return self._index.get(key)

    @_locked
    def write(self, key: str, data: builtins.bytes) -> bool:  # (in this class `bytes` is the property)
        """Store `data` under `key`, evicting the least recently used files if needed."""
        if not self.enabled or len(data) > self.capacity_bytes:
            return False
        self.remove(key)
        while self._bytes + len(data) > self.capacity_bytes and self._index:
            self.remove(next(iter(self._index)))
            self.evictions += 1
        path = self._path(key)
        tmp = path.with_name(path.name + ".tmp")
        encoded = key.encode()
        header = HEADER.pack(MAGIC, VERSION, len(encoded), len(data), zlib.crc32(data, zlib.crc32(encoded)))
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(encoded)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._disable(f"writing {path} failed: {exc}")
            return False
        self._index[key] = len(data)
        self._bytes += len(data)
        self.writes += 1
        return True

    @_locked
    def read(self, key: str) -> builtins.bytes | None:
        if key not in self._index:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
            data = _decode(raw, key)
        except (OSError, ValueError) as exc:
            log.error("SSD chunk %s is unreadable (%s): dropped", path, exc)
            self.corrupt += 1
            self.remove(key)
            return None
        self._index.move_to_end(key)
        self.reads += 1
        return data

    @_locked
    def remove(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is None:
            return
        self._bytes -= size
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove SSD chunk %s: %s", key, exc)

    # ---- internals ---------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return self.directory / digest[:2] / digest

    def _disable(self, reason: str) -> None:
        if self.enabled:
            log.error("SSD tier disabled, memory tier continues: %s", reason)
        self.enabled = False

    def _reindex(self) -> None:
        found = []
        for path in self.directory.glob("*/*"):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            try:
                with open(path, "rb") as f:
                    magic, version, key_len, data_len, _ = HEADER.unpack(f.read(HEADER.size))
                    key = f.read(key_len).decode()
                if (
                    magic != MAGIC
                    or version != VERSION
                    or path.stat().st_size != HEADER.size + key_len + data_len
                    or self._path(key) != path
                ):
                    raise ValueError("bad header")
            except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
                log.error("removing unreadable SSD chunk %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, key, data_len))
        for _, key, size in sorted(found):  # least recently written first
            self._index[key] = size
            self._bytes += size
        if found:
            log.info("SSD tier: %d chunks, %d bytes indexed from %s", len(found), self._bytes, self.directory)


def _decode(raw: bytes, key: str) -> bytes:
    if len(raw) < HEADER.size:
        raise ValueError("truncated header")
    magic, version, key_len, data_len, crc = HEADER.unpack_from(raw)
    body = memoryview(raw)[HEADER.size :]
    if magic != MAGIC or version != VERSION or len(body) != key_len + data_len:
        raise ValueError("bad header or truncated file")
    if bytes(body[:key_len]).decode() != key:
        raise ValueError("file holds another key")
    data = body[key_len:]
    if zlib.crc32(data, zlib.crc32(body[:key_len])) != crc:
        raise ValueError("checksum mismatch")
    return bytes(data)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
