"""The memory tier's backing store: one pre-faulted mapping, carved into extents.

Fresh memory costs a page fault per 4 KiB on first touch, which made a 1 MiB put several
times slower than a copy into memory already mapped; so the tier maps its whole capacity
once (populated up front where the OS allows) and hands out extents of it. Allocation takes
an exact-size free extent when there is one (KV chunks of one model all have the same size),
else the first extent large enough; freed extents coalesce with their neighbours.
"""

from __future__ import annotations

import bisect
import mmap

ALIGN = 64  # a cache line


class Arena:
    def __init__(self, capacity: int):
        self.capacity = capacity
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, max(capacity, 1), flags=flags)
        self.view = memoryview(self._map)
        self._starts: list[int] = [0] if capacity else []  # free extents, sorted by offset
        self._sizes: dict[int, int] = {0: capacity} if capacity else {}  # free extent start -> size
        self._by_size: dict[int, set[int]] = {capacity: {0}} if capacity else {}

    @staticmethod
    def footprint(size: int) -> int:
        return -(-size // ALIGN) * ALIGN

    def alloc(self, size: int) -> int | None:
        """The offset of a new extent of `size` bytes, or None if no free extent is large enough."""
        need = self.footprint(size)
        if need == 0:
            return 0
        exact = self._by_size.get(need)
        if exact:
            start = next(iter(exact))
        else:
            start = next((s for s in self._starts if self._sizes[s] >= need), None)
            if start is None:
                return None
        have = self._remove(start)
        if have > need:
            self._add(start + need, have - need)
        return start

    def free(self, start: int, size: int) -> None:
        size = self.footprint(size)
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
