"""Several models in one mesh (issue 33): the session's mesh has two in its catalogue (MESH_MODELS) and
workers for the first only. A request for the second waits until workers serving it join: pre-started
processes (llmesh.engine.standby) activated as its workers, as placement's activation will; then each
model answers exactly as its own monolithic engine, its requests mixed with the other's."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from llmesh.deploy.launcher import Child, activate, engine_cores, standby_ready, start_standby, stop_all
from llmesh.engine.models import resolve_model

from .conftest import BLOCK_SIZE, CATALOGUE, MAX_MODEL_LEN, MODEL_B, extra_workers, reference_engine
from .test_mesh import MODEL, token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def complete(mesh, model: str, ids: list[int], max_tokens: int = 16) -> list[int]:
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=130,
        headers=mesh.headers,
        json={"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


@contextmanager
def standby_workers(mesh, model_dir) -> Iterator[dict[str, Child]]:
    """A pre-started prefill and decode process (llmesh.engine.standby), each on the cores the launcher
    gives its role."""
    base = {
        "MESH_NATS_URL": mesh.nats_url,
        "MESH_MODEL_DIR": str(model_dir),
        "MESH_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "MESH_BLOCK_SIZE": str(BLOCK_SIZE),
        "MESH_MODELS": json.dumps(CATALOGUE),
    }
    cores = engine_cores()
    with extra_workers(mesh, timeout=60):
        standbys = {
            role: start_standby(base | cores.get(f"{role}-worker", {}), mesh.logs / f"{role}-standby.log")
            for role in ("prefill", "decode")
        }
        try:
            yield standbys
        finally:
            stop_all(list(standbys.values()), timeout=30)


def test_a_model_no_worker_serves_waits_for_its_workers_then_each_model_answers_as_its_own_engine(
    mesh, model_dir, reference, tmp_path
):
    listed = httpx.get(f"{mesh.url}/v1/models", headers=mesh.headers, timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [MODEL, MODEL_B]
    prompts = [token_prompt(n, seed=3300 + n) for n in (40, 300, 700)]
    with (
        reference_engine(resolve_model("llmesh/tiny-llama-b", model_dir), tmp_path) as reference_b,
        standby_workers(mesh, model_dir) as standbys,
        ThreadPoolExecutor(6) as pool,
    ):
        give_up = time.monotonic() + 180
        while not all(map(standby_ready, standbys.values())):
            assert time.monotonic() < give_up, "the standby processes did not get ready"
            time.sleep(0.5)
        waiting = [pool.submit(complete, mesh, MODEL_B, ids) for ids in prompts]
        time.sleep(3)
        assert not any(f.done() for f in waiting), [f.result() for f in waiting if f.done()]  # nothing serves B
        activated = time.monotonic()
        for role, standby in standbys.items():
            activate(standby, f"{role}-worker", {"MESH_SERVED_MODEL_NAME": MODEL_B, "MESH_WORKER_ID": f"{role}-b"})
        first = [f.result(timeout=130) for f in waiting]
        served_after = time.monotonic() - activated
        mixed = [pool.submit(complete, mesh, model, ids) for ids in prompts for model in (MODEL, MODEL_B)]
        mixed_out = [f.result(timeout=130) for f in mixed]
        expected_b = [reference_b.generate(16, prompt_token_ids=ids)["token_ids"] for ids in prompts]
    expected_a = [reference.generate(16, prompt_token_ids=ids)["token_ids"] for ids in prompts]
    print(f"the requests waiting for {MODEL_B} were answered {served_after:.1f} s after its standbys were activated")
    assert expected_a != expected_b  # otherwise this test could not tell the models apart
    assert first == expected_b
    assert mixed_out == [out for pair in zip(expected_a, expected_b) for out in pair]
