"""Tensor-parallel engines in the mesh: prefill and decode with 2 ranks, and with different sizes
(2 -> 1), give the same greedy tokens as monolithic engines, decode loading what prefill computed in
KV head groups (`kvkeys`), nothing reshuffled: bit for bit where both have the same size, up to
near-ties where they differ. (1 -> 2, one rank writing its layer in head groups that two ranks read
apart, is checked on tensors in tests/unit/test_kv_head_groups.py; here it cost 2 of the suite's 30
minutes, the readers' subsets being what 2 -> 2 loads too.)

On CPU each rank takes a core ('0|1'), so both engines share this machine's two. Runs its own
meshes, one for each pair of sizes.
"""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import pytest

from llmesh.wire.messages import KvStatsRequest

from .conftest import reference_engine, running_mesh
from .test_kv_identity import kv_request
from .test_live_migration import NEAR_TIE
from .test_mesh import token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.own_engines, pytest.mark.timeout(900)]
LAUNCHER = [sys.executable, "-m", "llmesh.deploy.launcher"]
LAYERS, KV_HEADS = 4, 4  # the embedded tiny model
# MESH_TEST_TP_PROMPTS more prompts and MESH_TEST_TP_TOKENS tokens each, for a measurement (docs/benchmarks.md)
PROMPTS = [token_prompt(600, seed=7070), token_prompt(130, seed=7171), token_prompt(37, seed=7272)] + [
    token_prompt(40 + 97 * i % 900, seed=7300 + i) for i in range(int(os.environ.get("MESH_TEST_TP_PROMPTS", "0")))
]
MAX_TOKENS = int(os.environ.get("MESH_TEST_TP_TOKENS", "24"))


@pytest.fixture(scope="module")
def expected(model_path, reference, tmp_path_factory):
    """The greedy tokens of monolithic engines with 1 rank (the session's) and 2, by their size (the one with 2
    stopped before any mesh starts: this machine's two cores are what both ranks of every engine use)."""
    with reference_engine(model_path, tmp_path_factory.mktemp("reference-tp2"), 2) as engine:  # loading with it
        return {
            ranks: [monolith.generate(MAX_TOKENS, prompt_token_ids=ids)["token_ids"] for ids in PROMPTS]
            for ranks, monolith in ((1, reference), (2, engine))
        }


def complete(mesh, ids: list[int]) -> list[int]:
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=120,
        headers=mesh.headers,
        json={
            "model": "llmesh/tiny-llama",
            "prompt": ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("prefill_ranks, decode_ranks", [(2, 2), (2, 1)])
def test_tensor_parallel_prefill_and_decode_are_exact(
    prefill_ranks, decode_ranks, expected, reference, tmp_path, model_dir
):
    env = {
        "MESH_PREFILL_TENSOR_PARALLEL_SIZE": str(prefill_ranks),
        "MESH_DECODE_TENSOR_PARALLEL_SIZE": str(decode_ranks),
        "MESH_LENGTH_SAMPLE_FRACTION": "0",
    }
    if prefill_ranks != decode_ranks:
        env["MESH_KV_HEADS_PER_CHUNK"] = str(KV_HEADS // 2)
    with running_mesh(tmp_path, model_dir, LAUNCHER, **env) as mesh:
        before = asyncio.run(kv_request(mesh.nats_url, KvStatsRequest()))
        outputs = [complete(mesh, ids) for ids in PROMPTS]
        after = asyncio.run(kv_request(mesh.nats_url, KvStatsRequest()))
    # decode loaded every block the prefill computed (the partial last one included), in 2 head groups a layer
    blocks = sum(-(-len(ids) // 128) for ids in PROMPTS)
    assert after.memory_hits - before.memory_hits == blocks * LAYERS * 2
    if prefill_ranks == decode_ranks:
        assert outputs == expected[decode_ranks]
        return
    # Ranks of different sizes sum a layer's partial products in different orders, so KV computed with 1
    # rank differs in its last bits from KV computed with 2: a decode that mixes them equals neither
    # monolith bit for bit, and may part from it where its likeliest tokens are that close.
    assert [tokens[0] for tokens in outputs] == [tokens[0] for tokens in expected[decode_ranks]]  # the prefill's
    parted = [
        (ids, tokens) for ids, tokens, reference in zip(PROMPTS, outputs, expected[decode_ranks]) if tokens != reference
    ]
    if parted:  # (decoded with 1 rank: the session's monolith)
        gaps = [max(reference.greedy_gaps(ids, tokens)) for ids, tokens in parted]
        print(
            f"{prefill_ranks} -> {decode_ranks} ranks: {len(parted)} of {len(PROMPTS)} outputs parted from the "
            f"monolith's, the chosen tokens at most {max(gaps):.3f} nats below its likeliest"
        )
        assert max(gaps) <= NEAR_TIE, f"a token {max(gaps):.3f} nats below the likeliest"
