"""llmesh.engine.kv_mover on its own, on the CPU and (where there is one) a GPU: runs in any order from several
shards, memory a device cannot copy at full speed going through pinned buffers (a test double of the host memory
that says so), and shared memory registered with the device copied straight into and out of."""

from __future__ import annotations

import mmap

import pytest
import torch

from llmesh.engine.kv_mover import HostMemory, KvMover

BLOCKS, HEADS, TOKENS, CONTENT, CHUNKS = 6, 4, 16, 8, 2
BLOCK_BYTES = HEADS * TOKENS * CONTENT * 2
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class CountedMemory(HostMemory):
    """Host memory counting the pinned buffers taken and given back."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.taken = self.given = 0

    def take(self, size: int) -> memoryview:
        self.taken += 1
        return super().take(size)

    def give(self, view: memoryview) -> None:
        self.given += 1
        super().give(view)


class SlowMemory(CountedMemory):
    """Host memory whose shared mappings the device could not register: every run is slow (a test double)."""

    def fast(self, view: memoryview) -> bool:
        return False


def kv_cache(device: str) -> torch.Tensor:
    return torch.randn(BLOCKS, HEADS, TOKENS, CONTENT).to(torch.bfloat16).to(device)


def host_bytes(cache: torch.Tensor, ids: list[int]) -> bytes:
    return cache[ids].cpu().view(torch.uint8).numpy().tobytes()


def interleaved_runs(blocks: int) -> tuple[list, list[memoryview]]:
    """Two shards' runs, each chunk to one of them by turns (as rendezvous hashing scatters keys)."""
    chunk = BLOCK_BYTES // CHUNKS
    positions = [list(range(0, blocks * CHUNKS, 2)), list(range(1, blocks * CHUNKS, 2))]
    views = [memoryview(bytearray(len(p) * chunk)) for p in positions]
    return list(zip(positions, views)), views


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_saved_to_interleaved_runs_through_pinned_buffers_load_back_exactly(device):
    cache = kv_cache(device)
    memory = SlowMemory(device)
    mover = KvMover({0: cache}, memory)
    runs, _ = interleaved_runs(3)
    mover.gather(0, mover.block_ids([4, 0, 2]), stable=False).write(runs, CHUNKS)
    assert memory.taken == memory.given == 2  # one pinned buffer a run, given back

    target = torch.zeros_like(cache)
    loader = KvMover({0: target}, memory)
    loader.start_step()
    loaded = loader.scatter(0, loader.block_ids([1, 3, 5]), runs[::-1], CHUNKS)
    loaded.release()
    assert loaded.missing == [] and memory.taken == memory.given == 3
    assert host_bytes(target, [1, 3, 5]) == host_bytes(cache, [4, 0, 2]) and not target[[0, 2, 4]].any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_with_a_chunk_missing_is_left_alone_and_named(device):
    cache = kv_cache(device)
    runs, _ = interleaved_runs(3)
    KvMover({0: cache}).gather(0, torch.tensor([4, 0, 2], device=device), stable=False).write(runs, CHUNKS)
    target = torch.zeros_like(cache)
    loader = KvMover({0: target})
    positions, view = runs[0]
    chunk = BLOCK_BYTES // CHUNKS
    partial = [(positions, view), (runs[1][0][:2], runs[1][1][: 2 * chunk])]  # block 2's second chunk is missing
    loaded = loader.scatter(0, loader.block_ids([1, 3, 5]), partial, CHUNKS)
    loaded.release()
    assert loaded.missing == [2]
    assert host_bytes(target, [1, 3]) == host_bytes(cache, [4, 0]) and not target[5].any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_saved_whole_from_the_cache_when_one_run_takes_it_all(device):
    cache = kv_cache(device)
    run = memoryview(bytearray(2 * BLOCK_BYTES))
    mover = KvMover({5: cache})
    mover.gather(5, mover.block_ids([3, 1]), stable=True).write([(range(2 * CHUNKS), run)], CHUNKS)
    assert bytes(run) == host_bytes(cache, [3, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_registered_shared_memory_is_copied_into_and_out_of_without_a_bounce(device):
    mapping = mmap.mmap(-1, 4 * BLOCK_BYTES, flags=mmap.MAP_SHARED)
    view = memoryview(mapping)
    memory = CountedMemory(device)
    memory.register(view)
    try:
        assert memory.fast(view[BLOCK_BYTES : 3 * BLOCK_BYTES])
        cache = kv_cache(device)
        mover = KvMover({0: cache}, memory)
        run = view[BLOCK_BYTES : 3 * BLOCK_BYTES]
        mover.gather(0, mover.block_ids([5, 2]), stable=False).write([(range(2 * CHUNKS), run)], CHUNKS)
        assert bytes(run) == host_bytes(cache, [5, 2])

        target = torch.zeros_like(cache)
        loader = KvMover({0: target}, memory)
        loader.start_step()
        loaded = loader.scatter(0, loader.block_ids([0, 4]), [(range(2 * CHUNKS), run)], CHUNKS)
        loader.wait(loaded.event)
        loaded.release()
        assert memory.taken == 0  # no pinned buffer in between
        assert host_bytes(target, [0, 4]) == host_bytes(cache, [5, 2])
        del run, loaded
    finally:
        memory.unregister(view)
        view.release()
        mapping.close()


def one_allocation(device: str, layers: list[int]) -> dict[int, torch.Tensor]:
    """Per-layer views of one buffer, a layer's stride apart, physically NHD (as vLLM 0.32 allocates them)."""
    buffer = torch.randn(len(layers), BLOCKS, TOKENS, HEADS, CONTENT).to(torch.bfloat16).to(device)
    return {layer: buffer[i].permute(0, 2, 1, 3) for i, layer in enumerate(sorted(layers))}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("allocation", ["one", "a layer each"])
def test_every_layer_gathered_at_once_is_written_a_part_at_a_time_layer_by_layer(device, allocation):
    """A step's write-behind: one gather of every layer's blocks (one indexed copy where the layers share an
    allocation), each request's part written to its own runs, layer after layer; the cache rewritten after
    the gather changes nothing written."""
    if allocation == "one":
        caches = one_allocation(device, [3, 0, 7])
    else:
        caches = {layer: kv_cache(device) for layer in (3, 0, 7)}
    before = {layer: cache.clone() for layer, cache in caches.items()}
    mover = KvMover(caches, CountedMemory(device))
    assert (mover.stacked is not None) == (allocation == "one")
    assert all(cache.dtype == torch.int64 for cache in mover.caches.values())  # bf16 indexed 4 at a time
    gathered = mover.gather_layers(mover.block_ids([5, 1, 4]))
    for cache in caches.values():
        cache.zero_()
    first, rest = memoryview(bytearray(3 * BLOCK_BYTES)), memoryview(bytearray(3 * 2 * BLOCK_BYTES))
    gathered.blocks(0, 1).write([(range(3 * CHUNKS), first)], CHUNKS)
    gathered.blocks(1, 2).write([(range(3 * 2 * CHUNKS), rest)], CHUNKS)
    assert bytes(first) == b"".join(host_bytes(before[layer], [5]) for layer in (0, 3, 7))
    assert bytes(rest) == b"".join(host_bytes(before[layer], [1, 4]) for layer in (0, 3, 7))
