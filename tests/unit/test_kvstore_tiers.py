"""The kv-store's memory and SSD tiers, on a real directory."""

from __future__ import annotations

import errno
import os

import pytest

from llmesh_kvstore.ssd import SsdTier
from llmesh_kvstore.store import ChunkStore


def chunk(tag: str, size: int = 1000) -> bytes:
    return (tag.encode() * size)[:size]


def test_memory_evictions_are_demoted_and_ssd_hits_promoted(tmp_path):
    store = ChunkStore(3000, SsdTier(tmp_path, 10_000))
    for key in "abc":
        store.put_many([(key, chunk(key))], pin_s=0)
    store.put_many([("d", chunk("d"))], pin_s=0)  # "a" goes to SSD, not away
    stats = store.stats()
    assert (stats.demotions, stats.evictions, stats.ssd_chunks, stats.chunks) == (1, 0, 1, 3)
    assert store.get("a") == chunk("a")  # from SSD, promoted (demoting "b")
    stats = store.stats()
    assert (stats.ssd_hits, stats.promotions, stats.memory_hits) == (1, 1, 0)
    assert store.get("a") == chunk("a") and store.stats().memory_hits == 1
    assert store.get("b") == chunk("b") and store.get("zzz") is None
    assert store.stats().misses == 1


def test_with_a_background_cleaner_a_put_evicts_what_is_on_ssd_or_drops_but_never_writes(tmp_path):
    store = ChunkStore(3000, SsdTier(tmp_path, 10_000))
    store.cleaned_in_background = True
    for key in "abc":
        store.put_many([(key, chunk(key))], pin_s=0)
    store.clean([("b", store._chunks["b"], memoryview(chunk("b")))])  # the cleaner copied "b" only
    store.put_many([("d", chunk("d"))], pin_s=0)  # "b" leaves memory for SSD: no write on this path
    store.put_many([("e", chunk("e"))], pin_s=0)  # nothing on SSD left to evict: "a" is dropped
    stats = store.stats()
    assert (stats.demotions, stats.evictions, stats.chunks, stats.ssd_chunks) == (1, 1, 3, 1)
    assert store.ssd is not None and store.ssd.writes == 1  # the cleaner's
    assert store.get("a") is None and store.get("b") == chunk("b")


def test_without_ssd_evictions_drop(tmp_path):
    store = ChunkStore(2000)
    for key in "abc":
        store.put_many([(key, chunk(key))], pin_s=0)
    assert store.get("a") is None and store.stats().evictions == 1


def test_ssd_capacity_evicts_least_recently_used(tmp_path):
    ssd = SsdTier(tmp_path, 2500)
    for key in "abc":
        assert ssd.write(key, chunk(key))
    assert "a" not in ssd and ssd.read("b") == chunk("b") and ssd.evictions == 1
    assert ssd.bytes == 2000


def test_restart_reindexes_and_cleans_crash_leftovers(tmp_path):
    ssd = SsdTier(tmp_path, 10_000)
    ssd.write("kept", chunk("k"))
    ssd.write("second", chunk("s", 300))
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "abcdef.tmp").write_bytes(b"half a write")
    (tmp_path / "ab" / "garbage").write_bytes(b"not a chunk at all")
    again = SsdTier(tmp_path, 10_000)
    assert len(again) == 2 and again.bytes == 1300
    assert again.read("kept") == chunk("k") and again.read("second") == chunk("s", 300)
    assert not (tmp_path / "ab" / "abcdef.tmp").exists() and not (tmp_path / "ab" / "garbage").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_or_truncated_files_are_clean_misses(tmp_path, damage):
    ssd = SsdTier(tmp_path, 10_000)
    ssd.write("victim", chunk("v"))
    ssd.write("healthy", chunk("h"))
    path = ssd._path("victim")
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-10] ^= 0xFF
    else:
        raw = raw[:-10]
    path.write_bytes(bytes(raw))
    assert ssd.read("victim") is None and ssd.corrupt == 1 and "victim" not in ssd
    assert ssd.read("healthy") == chunk("h")


def test_unusable_directory_disables_the_tier_and_memory_keeps_working(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    store = ChunkStore(2000, SsdTier(blocker / "dir", 10_000))
    assert not store.stats().ssd_enabled
    for key in "abc":
        store.put_many([(key, chunk(key))], pin_s=0)
    assert store.get("c") == chunk("c") and store.stats().evictions == 1


def test_disk_full_disables_the_tier_but_keeps_what_memory_holds(tmp_path, monkeypatch):
    store = ChunkStore(2000, SsdTier(tmp_path, 10_000))

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    for key in "abc":
        store.put_many([(key, chunk(key))], pin_s=0)  # demoting "a" hits the full disk
    stats = store.stats()
    assert not stats.ssd_enabled and stats.evictions == 1 and stats.demotions == 0
    assert store.get("b") == chunk("b") and store.get("c") == chunk("c")
    assert not list(tmp_path.glob("*/*.tmp"))  # no half-written file left behind


def test_flush_moves_everything_to_ssd_pins_included(tmp_path):
    store = ChunkStore(10_000, SsdTier(tmp_path, 10_000))
    store.put_many([("pinned", chunk("p"))], pin_s=60)
    store.put_many([("free", chunk("f"))], pin_s=0)
    store.flush_to_ssd()
    stats = store.stats()
    assert (stats.chunks, stats.bytes, stats.ssd_chunks, stats.demotions) == (0, 0, 2, 2)
    assert store.get("pinned") == chunk("p") and store.stats().ssd_hits == 1


def test_an_empty_ssd_tier_reports_enabled(tmp_path):
    assert ChunkStore(1000, SsdTier(tmp_path, 10_000)).stats().ssd_enabled


def test_the_cleaner_copies_lru_chunks_to_ssd_so_eviction_writes_nothing(tmp_path):
    from llmesh_kvstore.state import ShardState

    ssd = SsdTier(tmp_path, 100_000)
    state = ShardState(ChunkStore(4000, ssd))
    for key in "abc":
        state.store.put_many([(key, chunk(key))], pin_s=0)  # 3000 of 4000 bytes
    assert state.clean_once(0.5) == 0  # 1000 bytes over the 2000-byte mark, but nothing was read: all to be dropped
    assert state.clean_once(0.5, unread_too=True) == 1  # the least recently used, "a"
    assert "a" in ssd and "b" not in ssd and state.store.stats().chunks == 3  # and it stays in memory
    writes = ssd.writes
    state.store.put_many([("d", chunk("d")), ("e", chunk("e"))], pin_s=0)  # evicts "a": already on SSD
    assert ssd.writes == writes and state.store.stats().demotions == 1
    assert state.store.get("a") == chunk("a")  # from SSD
    assert state.clean_once(0.99, unread_too=True) == 1  # promoting "a" filled memory: the oldest dirty chunk is copied
    assert state.clean_once(0.99, unread_too=True) == 0  # what lies over the mark is clean: nothing to do


def test_the_cleaner_copies_only_chunks_read_unless_told_otherwise(tmp_path):
    from llmesh_kvstore.state import ShardState

    ssd = SsdTier(tmp_path, 100_000)
    state = ShardState(ChunkStore(4000, ssd))
    for key in "abc":
        state.store.put_many([(key, chunk(key))], pin_s=0)
    assert state.store.get("b") == chunk("b")  # "b" is reused; "a" and "c" never read
    assert state.clean_once(0.0) == 1 and "b" in ssd and "a" not in ssd and "c" not in ssd  # "b" alone copied


def test_a_grant_takes_what_is_free_rather_than_evicting_for_a_whole_slab():
    """Half the store is held by chunks: a client's slab of the whole store would evict them all, while
    what it needs fits in what is free."""
    store = ChunkStore(64 * 1024)
    for key in "abcd":
        store.put_many([(key, chunk(key, 8 * 1024))], pin_s=0)
    slab = store.grant(64 * 1024, least=16 * 1024)
    assert slab.end - slab.offset >= 16 * 1024
    assert store.stats().evictions == 0 and all(key in store for key in "abcd")
    store.release_slab(slab)
    whole = store.grant(48 * 1024)  # without `least`: the size asked, contiguous, evicting for it
    assert whole.end - whole.offset == 48 * 1024 and store.stats().evictions == 4  # all, to join the free space


def test_a_fill_guard_revoked_before_the_copy_stops_it_and_after_it_changes_nothing():
    import threading

    from llmesh.engine.kvclient import FillGuard
    from llmesh.wire.errors import Timeout

    copied = []
    early = FillGuard()
    early.revoke()
    with pytest.raises(Timeout):
        early.guarded(lambda views: copied.append("early"))([])
    late, started, release = FillGuard(), threading.Event(), threading.Event()

    def slow_copy(views):
        started.set()
        release.wait(5)
        copied.append("late")

    copier = threading.Thread(target=late.guarded(slow_copy), args=([],))
    copier.start()
    started.wait(5)
    revoked = threading.Thread(target=late.revoke)
    revoked.start()
    revoked.join(0.2)
    assert revoked.is_alive()  # revoke waits for the copy under way
    release.set()
    revoked.join(5)
    copier.join(5)
    assert copied == ["late"]
