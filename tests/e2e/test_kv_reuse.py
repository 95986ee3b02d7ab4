"""KV reuse across instances through the kv-store: a prefix stored by one prefill worker is
loaded by another, and decode writes generated KV back for a conversation's next turn. Both
are exact against a monolithic vLLM engine that has the same prefix in its own cache. And a
chunk that rots on SSD is a clean miss that decode recomputes, with the same output.

Loads are counted by the kv-store's hit counter between prefill and decode (the decode
worker's own vLLM prefix cache may spare it some loads, so only the prefill's are exact)."""

from __future__ import annotations

import asyncio

import pytest
from e2e.test_mesh import BLOCK_SIZE, NUM_LAYERS, disaggregated, kv_stats, live_worker, start_extra_worker, token_prompt

from llmesh.wire.kvkeys import block_hashes, chunk_key
from llmesh_kvstore.ssd import SsdTier

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def second_prefill_worker(mesh, model_dir):
    yield from start_extra_worker(mesh, model_dir, "prefill", "prefill-second")


def prefill_loads(mesh, ids: list[int], max_tokens: int = 16, **kwargs) -> tuple[list[int], int, int]:
    """Tokens of a disaggregated request, and the chunks its prefill loaded and stored."""
    stats = [asyncio.run(kv_stats(mesh))]

    async def after_prefill():
        stats.append(await kv_stats(mesh))

    tokens = asyncio.run(disaggregated(mesh, ids, max_tokens, between=after_prefill, **kwargs))
    before, after = stats
    assert after.misses == before.misses
    return tokens, after.hits - before.hits, after.puts - before.puts


@pytest.fixture(scope="module")
def first_prefill_worker(mesh, second_prefill_worker):
    """The prefill worker `make run` started."""
    while (worker := asyncio.run(live_worker(mesh, "prefill")).worker_id) == second_prefill_worker:
        pass
    return worker


def test_prefix_stored_by_one_prefill_worker_is_loaded_by_another(
    mesh, reference, first_prefill_worker, second_prefill_worker
):
    a = token_prompt(600, seed=4242)
    b = a[: 4 * BLOCK_SIZE] + token_prompt(201, seed=4343)[1:]  # 4 shared full blocks, then 200 other tokens
    # The reference serves B right after A, so its own prefix cache holds A's blocks (as the store does ours).
    expected_a = reference.generate(16, prompt_token_ids=a)["token_ids"]
    expected_b = reference.generate(16, prompt_token_ids=b)["token_ids"]
    tokens, loaded, stored = prefill_loads(mesh, a, prefill_worker=first_prefill_worker)
    assert tokens == expected_a and loaded == 0 and stored == 5 * NUM_LAYERS  # 4 full blocks and a partial one
    tokens, loaded, stored = prefill_loads(mesh, b, prefill_worker=second_prefill_worker)
    assert tokens == expected_b
    assert loaded == 4 * NUM_LAYERS  # the shared blocks, which this worker never computed
    assert stored == 2 * NUM_LAYERS  # only what it computed: block 4 and the partial block 5


def test_stored_prefixes_are_shared_only_within_a_cache_salt(
    mesh, reference, first_prefill_worker, second_prefill_worker
):
    ids = token_prompt(600, seed=6161)  # blocks 0-3 full, block 4 partial
    expected = reference.generate(16, prompt_token_ids=ids)["token_ids"]
    tokens, loaded, stored = prefill_loads(mesh, ids, prefill_worker=first_prefill_worker, cache_salt="tenant-a")
    assert tokens == expected and loaded == 0 and stored == 5 * NUM_LAYERS
    # The same prompt from another tenant, on the worker that never saw it: nothing is shared.
    tokens, loaded, stored = prefill_loads(mesh, ids, prefill_worker=second_prefill_worker, cache_salt="tenant-b")
    assert tokens == expected and loaded == 0 and stored == 5 * NUM_LAYERS
    # The first tenant again, on that worker: its 4 full blocks come from the store.
    tokens, loaded, stored = prefill_loads(mesh, ids, prefill_worker=second_prefill_worker, cache_salt="tenant-a")
    assert tokens == expected and loaded == 4 * NUM_LAYERS and stored == NUM_LAYERS


def test_decode_writes_generated_kv_back_for_the_next_turn(
    mesh, reference, first_prefill_worker, second_prefill_worker
):
    turn1 = token_prompt(370, seed=5151)  # blocks 0-1 full; generation completes block 2
    out1, loaded, _ = prefill_loads(mesh, turn1, max_tokens=40, prefill_worker=first_prefill_worker)
    assert out1 == reference.generate(40, prompt_token_ids=turn1)["token_ids"] and loaded == 0
    assert len(turn1) + len(out1) >= 3 * BLOCK_SIZE, "generation stopped before filling block 2"
    turn2 = turn1 + out1 + token_prompt(60, seed=5252)[1:]
    # the next turn goes to the other prefill worker, which has none of this conversation cached
    tokens, loaded, _ = prefill_loads(mesh, turn2, prefill_worker=second_prefill_worker)
    assert tokens == reference.generate(16, prompt_token_ids=turn2)["token_ids"]
    assert loaded == 3 * NUM_LAYERS  # the history's full blocks, block 2 of which only the decode had written


def test_a_corrupt_chunk_is_a_clean_miss_and_decode_recomputes_exactly(mesh, reference):
    ids = token_prompt(600, seed=3131)  # blocks 0-3 full, block 4 partial
    fingerprint = asyncio.run(live_worker(mesh, "decode")).fingerprint
    victim = chunk_key(block_hashes(fingerprint, ids, BLOCK_SIZE)[3], 2, 0)  # layer 2, the one head group

    async def spill_and_corrupt():
        await kv_stats(mesh, "flush")  # everything to SSD, where a file can rot
        path = SsdTier(mesh.kv_data / "shard-0", 1 << 40)._path(victim)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(data)

    before = asyncio.run(kv_stats(mesh))
    tokens = asyncio.run(disaggregated(mesh, ids, between=spill_and_corrupt))
    after = asyncio.run(kv_stats(mesh))
    assert after.ssd_corrupt - before.ssd_corrupt == 1 and after.misses - before.misses == 1  # a clean miss
    assert tokens == reference.generate(16, prompt_token_ids=ids)["token_ids"]  # decode recomputed from block 3
