"""KV never crosses checkpoints: a new fine-tune at the same path, started on the same kv-store
data directory, computes its own KV instead of loading the old weights' chunks from SSD.

Runs its own meshes (first in this folder, before the session's mesh is started).
"""

from __future__ import annotations

import asyncio
import shutil
import sys

import httpx
import pytest

from llmesh.engine.models import EMBEDDED, build_model
from llmesh.wire.bus import Bus
from llmesh.wire.config import EMBEDDED_MODEL
from llmesh.wire.messages import KvFlush, KvStats, KvStatsRequest, Subjects

from .conftest import reference_engine, running_mesh
from .test_mesh import token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.own_engines, pytest.mark.timeout(900)]
SERVED = "tuned"
LAUNCHER = [sys.executable, "-m", "llmesh.deploy.launcher"]


async def kv_request(nats_url: str, request) -> KvStats:
    bus = await Bus.connect(nats_url, "test-kv")
    try:
        return (
            await bus.request(
                Subjects.kv("0", "flush" if isinstance(request, KvFlush) else "stats"), request, KvStats, timeout=30
            )
        )[0]
    finally:
        await bus.close()


def complete(mesh, ids: list[int]) -> list[int]:
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=120,
        headers=mesh.headers,
        json={"model": SERVED, "prompt": ids, "max_tokens": 16, "temperature": 0, "return_token_ids": True},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_new_weights_at_the_same_path_never_load_the_old_checkpoints_kv(tmp_path, model_dir, model_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(model_path, checkpoint)
    env = {"MESH_MODEL": str(checkpoint), "MESH_SERVED_MODEL_NAME": SERVED, "MESH_DATA_DIR": str(tmp_path / "kv")}
    ids = token_prompt(600, seed=8181)  # 4 full blocks and a partial one
    with running_mesh(tmp_path / "first", model_dir, LAUNCHER, **env) as mesh:
        old = complete(mesh, ids)
        asyncio.run(kv_request(mesh.nats_url, KvFlush()))  # the chunks outlive the store's memory

    build_model(tmp_path / "fine-tune", *EMBEDDED[EMBEDDED_MODEL], seed=4321)
    weights = checkpoint / "model.safetensors"
    stat = weights.stat()
    shutil.copyfile(tmp_path / "fine-tune" / "model.safetensors", weights)  # in place: same inode
    assert weights.stat().st_size == stat.st_size  # same shapes: only the content tells them apart

    with (
        reference_engine(str(checkpoint), tmp_path) as reference,
        running_mesh(tmp_path / "second", model_dir, LAUNCHER, **env) as mesh,
    ):  # the same data directory
        before = asyncio.run(kv_request(mesh.nats_url, KvStatsRequest()))
        assert before.ssd_chunks >= 5 * 4, "the old checkpoint's chunks are not in the store"
        new = complete(mesh, ids)
        after = asyncio.run(kv_request(mesh.nats_url, KvStatsRequest()))
        expected = reference.generate(16, prompt_token_ids=ids)["token_ids"]
    assert new == expected
    assert new != old  # otherwise this test could not tell the checkpoints apart
    assert after.ssd_hits == before.ssd_hits  # nothing of the old checkpoint was read
    assert after.memory_hits - before.memory_hits == 5 * 4  # decode loaded what this prefill computed
