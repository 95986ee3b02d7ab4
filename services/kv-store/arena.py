"""The memory tier's backing store: one pre-faulted mapping, carved into extents.

Fresh memory costs a page fault per 4 KiB on first touch, which made a 1 MiB put several
times slower than a copy into memory already mapped; so the tier maps its whole capacity
once (populated up front where the OS allows) and hands out extents of it. Allocation takes
an exact-size free extent when there is one (KV chunks of one model all have the same size),
else the first extent large enough; freed extents coalesce with their neighbours.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import uuid

from llmesh.wire.kvwire import SHM_DIR, footprint

log = logging.getLogger(__name__)

POPULATE = getattr(mmap, "MAP_POPULATE", 0)
NAME_PREFIX = "llmesh-arena-"


class Arena:
    """`shared`: back it with a file under /dev/shm that clients on this host map too, so they
    write put values straight into the extents reserved for them (falls back to private memory
    when /dev/shm cannot hold it)."""

    def __init__(self, capacity: int, shared: bool = False):
        self.capacity = capacity
        self.name: str | None = None
        self._map = self._shared_map(capacity) if shared and capacity else None
        if self._map is None:
            self._map = mmap.mmap(-1, max(capacity, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | POPULATE)
        self.view = memoryview(self._map)
        self._starts: list[int] = [0] if capacity else []  # free extents, sorted by offset
        self._sizes: dict[int, int] = {0: capacity} if capacity else {}  # free extent start -> size
        self._by_size: dict[int, set[int]] = {capacity: {0}} if capacity else {}

    def _shared_map(self, capacity: int) -> mmap.mmap | None:
        remove_stale_arenas()
        name = f"{NAME_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            log.info("no shared arena (%s): clients copy through their own segments", exc)
            return None
        try:
            os.posix_fallocate(fd, 0, capacity)  # ENOSPC now rather than SIGBUS later
            mapped = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | POPULATE)
        except OSError as exc:
            log.info(
                "no shared arena of %d bytes in %s (%s): clients copy through their own segments",
                capacity,
                SHM_DIR,
                exc,
            )
            (SHM_DIR / name).unlink(missing_ok=True)
            return None
        finally:
            os.close(fd)
        self.name = name
        return mapped

    def close(self) -> None:
        """Remove the shared name (clients already attached keep their mapping)."""
        if self.name is not None:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self.name = None

    def alloc(self, size: int) -> int | None:
        """The offset of a new extent of `size` bytes, or None if no free extent is large enough."""
        need = footprint(size)
        if need == 0:
            return 0
        exact = self._by_size.get(need)
        start = next(iter(exact)) if exact else next((s for s in self._starts if self._sizes[s] >= need), None)
        if start is None:
            return None
        have = self._remove(start)
        if have > need:
            self._add(start + need, have - need)
        return start

    def free(self, start: int, size: int) -> None:
        size = footprint(size)
        if size == 0:
            return
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + size:  # merge with the next extent
            size += self._remove(start + size)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:  # merge with the previous extent
                start, size = prev, self._sizes[prev] + size
                self._remove(prev)
        self._add(start, size)

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes.values())

    def _add(self, start: int, size: int) -> None:
        bisect.insort(self._starts, start)
        self._sizes[start] = size
        self._by_size.setdefault(size, set()).add(start)

    def _remove(self, start: int) -> int:
        self._starts.pop(bisect.bisect_left(self._starts, start))
        size = self._sizes.pop(start)
        same = self._by_size[size]
        same.discard(start)
        if not same:
            del self._by_size[size]
        return size


def remove_stale_arenas() -> None:
    """Arena files of shards that died without removing theirs (the name carries the pid)."""
    for path in SHM_DIR.glob(f"{NAME_PREFIX}*"):
        try:
            pid = int(path.name[len(NAME_PREFIX) :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass  # not ours to judge
