"""llmesh.engine.kv_mover on its own: runs in any order from several shards, and memory a device cannot copy at
full speed going through pinned buffers (on the CPU, with a test double of the host memory that says so)."""

from __future__ import annotations

import torch

from llmesh.engine.kv_mover import HostMemory, KvMover

BLOCKS, HEADS, TOKENS, CONTENT, CHUNKS = 6, 4, 16, 8, 2
BLOCK_BYTES = HEADS * TOKENS * CONTENT * 2


class SlowMemory(HostMemory):
    """Host memory whose shared mappings the device could not register: every run is slow (a test double)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.taken = self.given = 0

    def fast(self, view: memoryview) -> bool:
        return False

    def take(self, size: int) -> memoryview:
        self.taken += 1
        return super().take(size)

    def give(self, view: memoryview) -> None:
        self.given += 1


def interleaved_runs(blocks: int) -> tuple[list, list[memoryview]]:
    """Two shards' runs, each chunk to one of them by turns (as rendezvous hashing scatters keys)."""
    chunk = BLOCK_BYTES // CHUNKS
    positions = [list(range(0, blocks * CHUNKS, 2)), list(range(1, blocks * CHUNKS, 2))]
    views = [memoryview(bytearray(len(p) * chunk)) for p in positions]
    return list(zip(positions, views)), views


def test_blocks_saved_to_interleaved_runs_through_pinned_buffers_load_back_exactly():
    cache = torch.randn(BLOCKS, HEADS, TOKENS, CONTENT).to(torch.bfloat16)
    memory = SlowMemory()
    mover = KvMover({0: cache}, memory)
    runs, _ = interleaved_runs(3)
    mover.gather(0, torch.tensor([4, 0, 2]), stable=False).write(runs, CHUNKS)
    assert memory.taken == memory.given == 2  # one pinned buffer a run, given back

    target = torch.zeros_like(cache)
    loaded = KvMover({0: target}, memory).scatter(0, torch.tensor([1, 3, 5]), runs[::-1], CHUNKS)
    loaded.release()
    assert loaded.missing == [] and memory.taken == memory.given == 3
    assert torch.equal(target[[1, 3, 5]], cache[[4, 0, 2]]) and not target[[0, 2, 4]].any()


def test_a_block_saved_whole_from_the_cache_when_one_run_takes_it_all():
    cache = torch.randn(BLOCKS, HEADS, TOKENS, CONTENT).to(torch.bfloat16)
    run = memoryview(bytearray(2 * BLOCK_BYTES))
    KvMover({5: cache}).gather(5, torch.tensor([3, 1]), stable=True).write([(range(2 * CHUNKS), run)], CHUNKS)
    assert bytes(run) == cache[[3, 1]].view(torch.uint8).numpy().tobytes()
