"""The benchmark engine (llmesh_sim.modelled_engine) behind the real worker services, in a whole mesh the launcher
starts: it streams through the router as vLLM does, its KV crosses the real kv-store (a prefill's written, its
decode's read), its steps take the GPU profile's times, and a client that leaves frees its slot."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import pytest
from e2e.conftest import running_mesh
from e2e.test_mesh import kv_stats, live_worker

from llmesh.wire.config import EMBEDDED_MODEL
from llmesh_sim.modelled_engine import load_profile, profile_path

pytestmark = [pytest.mark.e2e, pytest.mark.own_engines]
PROFILE = "h100-llama2-7b"
KV_BYTES_PER_TOKEN = 4096
BLOCK_SIZE, CHUNKS_PER_BLOCK = 128, 4  # the embedded model: 4 layers, one head group a layer


@pytest.fixture(scope="module")
def modelled(tmp_path_factory, model_dir, model_path):
    work = tmp_path_factory.mktemp("modelled")
    with running_mesh(
        work,
        model_dir,
        [sys.executable, "-m", "llmesh.deploy.launcher"],
        MESH_MODELLED_ENGINE=PROFILE,
        MESH_MODELLED_KV_BYTES_PER_TOKEN=str(KV_BYTES_PER_TOKEN),
        MESH_MODELLED_TIMINGS_DIR=str(work / "timings"),
    ) as mesh:
        mesh.timings = work / "timings"
        yield mesh


def stream(mesh, prompt: str, max_tokens: int, chunks: int | None = None) -> tuple[list[float], dict, str]:
    """The arrival times of a streamed completion's token chunks (after `chunks` of them the client leaves), its
    usage and id."""
    body = {"model": EMBEDDED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    times, usage, request_id = [], {}, ""
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, headers=mesh.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            request_id = event["id"]
            usage = event.get("usage") or usage
            if event["choices"]:
                times.append(time.monotonic())
                if chunks is not None and len(times) == chunks:
                    break
    return times, usage, request_id


def test_a_disaggregated_stream_moves_its_kv_through_the_store(modelled):
    before = asyncio.run(kv_stats(modelled))
    times, usage, _ = stream(modelled, "the quick brown fox " * 80, 40)
    after = asyncio.run(kv_stats(modelled))
    # every request to its length (in up to as many chunks: deltas the router fell behind on join into one)
    assert usage["completion_tokens"] == 40 and 0 < len(times) <= 40
    chunks = -(-usage["prompt_tokens"] // BLOCK_SIZE) * CHUNKS_PER_BLOCK  # the prompt's blocks, the last partial
    kv_bytes = chunks * BLOCK_SIZE * KV_BYTES_PER_TOKEN // CHUNKS_PER_BLOCK
    assert (after.puts - before.puts, after.bytes_put - before.bytes_put) == (chunks, kv_bytes)
    assert (after.hits - before.hits, after.bytes_got - before.bytes_got) == (chunks, kv_bytes)  # its decode's read


def test_steps_take_the_profiles_time(modelled):
    profile = load_profile(profile_path(PROFILE))
    times, usage, request_id = stream(modelled, "a b c d " * 100, 64)
    # a decode step a token, none shorter than its fixed cost (from the first chunk to the last)
    assert usage["completion_tokens"] == 64 and times[-1] - times[0] >= (63 - (64 - len(times))) * profile.base_s
    engine = {}
    for path in modelled.timings.glob("*.tsv"):
        for line in path.read_text().splitlines():
            engine_id, seconds = line.split("\t")
            if request_id in engine_id:
                engine[engine_id.split("-", 1)[0]] = float(seconds)
    assert set(engine) == {"prefill", "decode"}  # each engine's time to its first token, by the router's id
    assert engine["prefill"] >= profile.step_s(usage["prompt_tokens"], 0, 0)


def test_a_client_that_leaves_frees_its_slot(modelled):
    stream(modelled, "hello there", 5000, chunks=3)
    give_up = time.monotonic() + 10
    while (info := asyncio.run(live_worker(modelled, "decode"))) is None or info.running:
        assert time.monotonic() < give_up, f"the decode worker still runs {info and info.running} requests"
