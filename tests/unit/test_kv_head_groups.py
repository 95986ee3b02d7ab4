"""KV head groups: a rank of any tensor-parallel size saves and loads only its own heads' chunks,
and what ranks of one size saved, ranks of another load whole (real tensors, vLLM's cache layout)."""

from __future__ import annotations

import pytest
import torch

from llmesh.engine.kv_connector.metadata import HeadSlice, layer_keys, rank_slices
from llmesh.engine.kv_mover import KvMover
from llmesh.wire.kvkeys import block_chunk_keys, chunk_key, heads_per_chunk

HEADS, BLOCKS, TOKENS, KV = 4, 6, 16, 8  # vLLM's per-layer view: [blocks, KV heads, tokens, K|V]


def layout(per: int) -> dict:
    return {"num_layers": 2, "num_kv_heads": HEADS, "kv_heads_per_chunk": per}


def test_a_chunk_holds_a_ranks_share_unless_configured_smaller():
    assert heads_per_chunk(8, 1) == 8 and heads_per_chunk(8, 2) == 4 and heads_per_chunk(8, 2, configured=2) == 2
    assert heads_per_chunk(2, 4) == 1  # fewer heads than ranks: each rank holds a copy of one
    with pytest.raises(ValueError, match="does not divide the 4 KV heads each of the 2"):
        heads_per_chunk(8, 2, configured=3)


def test_each_rank_names_the_groups_of_the_heads_it_holds():
    assert rank_slices(layout(2), 1, 0) == [HeadSlice(0, 0, 2), HeadSlice(1, 2, 2)]
    assert rank_slices(layout(2), 2, 1) == [HeadSlice(1, 0, 2)]
    assert rank_slices(layout(1), 2, 1) == [HeadSlice(2, 0, 1), HeadSlice(3, 1, 1)]
    assert [rank_slices({"num_kv_heads": 2, "kv_heads_per_chunk": 1}, 4, r) for r in range(4)] == [
        [HeadSlice(0, 0, 1)]
    ] * 2 + [[HeadSlice(1, 0, 1)]] * 2


def test_a_block_is_stored_whole_only_with_every_layer_and_head_group():
    assert block_chunk_keys("ab", layout(1)) == [chunk_key("ab", layer, g) for layer in (0, 1) for g in range(4)]
    assert block_chunk_keys("ab", layout(4)) == ["ab:0:0", "ab:1:0"]


def save(slices: list[HeadSlice], cache: torch.Tensor, block_ids: list[int], layer: int) -> dict:
    """What a rank puts for `block_ids` of one layer, by key, each chunk in its own buffer (as when
    every chunk goes to another shard)."""
    keys = layer_keys([f"h{b}" for b in block_ids], layer, slices)
    views = [memoryview(bytearray(cache[0].numel() * cache.element_size() // len(slices))) for _ in keys]
    KvMover({layer: cache}).gather(layer, torch.tensor(block_ids), stable=True).write(
        [([i], v) for i, v in enumerate(views)], len(slices)
    )
    return dict(zip(keys, views))


def fetched(store: dict, keys: list[str]) -> list:
    """A get's runs: one buffer holding every value when all are there (one shard), else one a value."""
    values = [store.get(k) for k in keys]
    if all(v is not None for v in values):
        return [(range(len(keys)), memoryview(b"".join(values)))]
    return [([i], v) for i, v in enumerate(values) if v is not None]


@pytest.mark.parametrize("writer_tp, reader_tp", [(2, 1), (1, 2), (2, 2), (1, 4), (4, 1)])
def test_kv_written_by_one_tensor_parallel_size_loads_exactly_into_another(writer_tp, reader_tp):
    per = heads_per_chunk(HEADS, max(writer_tp, reader_tp))
    full = torch.randn(BLOCKS, HEADS, TOKENS, KV, dtype=torch.bfloat16)  # the whole model's cache of one layer
    share = HEADS // writer_tp
    store = {}
    for r in range(writer_tp):
        store |= save(
            rank_slices(layout(per), writer_tp, r), full[:, r * share : (r + 1) * share].contiguous(), [1, 4], 3
        )

    share = HEADS // reader_tp
    for r in range(reader_tp):
        slices = rank_slices(layout(per), reader_tp, r)
        cache = torch.zeros(BLOCKS, share, TOKENS, KV, dtype=torch.bfloat16)
        runs = fetched(store, layer_keys(["h1", "h4"], 3, slices))
        assert KvMover({3: cache}).scatter(3, torch.tensor([2, 5]), runs, len(slices)).missing == []
        assert torch.equal(cache[2], full[1, r * share : (r + 1) * share])
        assert torch.equal(cache[5], full[4, r * share : (r + 1) * share])
        assert not cache[[0, 1, 3, 4]].any()


def test_a_missing_head_group_is_a_missing_block():
    cache = torch.zeros(BLOCKS, HEADS, TOKENS, KV, dtype=torch.bfloat16)
    chunk = memoryview(bytearray(b"\1" * (TOKENS * KV * 2)))
    present = [0, 1, 2, 3, 4, 6, 7]  # block 1's second head group is missing
    scattered = KvMover({0: cache}).scatter(0, torch.tensor([0, 1]), [(present, memoryview(bytes(chunk) * 7))], 4)
    assert scattered.missing == [1]
    assert cache[0].view(torch.uint8).eq(1).all() and not cache[1].any()
