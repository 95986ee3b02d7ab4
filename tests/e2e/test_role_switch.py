"""BanaServe's adaptive module migration on real engines: a decode worker built with both roles
(`MESH_SWITCHABLE=1`) is switched to prefill by the placement service when prefill load piles up,
and then prefills requests itself, exactly."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from llmesh.bus import Bus
from llmesh.messages import PlacementDecision, Subjects

from .conftest import MAX_MODEL_LEN
from .test_mesh import MODEL, live_worker, start_extra_worker, token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SWITCHABLE = "decode-switchable"


@pytest.fixture(scope="module")
def switchable_worker(mesh, model_dir):
    yield from start_extra_worker(mesh, model_dir, "decode", SWITCHABLE, MESH_SWITCHABLE="1")


async def complete(http: httpx.AsyncClient, url: str, ids: list[int]) -> list[int]:
    resp = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4,
                                                          "temperature": 0, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_a_switchable_worker_takes_prefill_load(mesh, reference, switchable_worker):
    """Long prompts with short answers, many at once: the prefill pool's load exceeds decode's for
    longer than the placement's hold time, so placement switches the switchable decode worker to
    prefill (decode keeps the mesh's own worker); the routers then send it prefills, and every answer
    equals a monolithic engine's."""
    assert (asyncio.run(live_worker(mesh, "decode", SWITCHABLE))).roles == ["prefill", "decode"]
    prompts = [token_prompt(MAX_MODEL_LEN - 16, seed=3000 + i) for i in range(12)]

    async def load() -> tuple[list[PlacementDecision], dict[int, list[int]]]:
        bus = await Bus.connect(mesh.nats_url, "test-roles")
        decisions: list[PlacementDecision] = []

        async def on_decision(decision, blob):
            if decision.kind == "role" and decision.detail.get("worker_id") == SWITCHABLE:
                decisions.append(decision)

        await bus.serve(Subjects.PLACEMENT_EVENTS, on_decision)
        answers: dict[int, list[int]] = {}
        try:
            async with httpx.AsyncClient(timeout=300) as http:
                give_up = time.monotonic() + 240
                switched_at = None
                while switched_at is None or time.monotonic() < switched_at + 8:  # and a while after
                    assert time.monotonic() < give_up, "no role switch under prefill load"
                    outs = await asyncio.gather(*(complete(http, mesh.url, ids) for ids in prompts))
                    answers.update(enumerate(outs))
                    if switched_at is None and any(d.detail.get("outcome") == "accepted" for d in decisions):
                        switched_at = time.monotonic()
        finally:
            await bus.close()
        return decisions, answers

    decisions, answers = asyncio.run(load())
    decision = next(d for d in decisions if d.detail.get("outcome") == "accepted")
    assert decision.reason == "banaserve" and decision.detail["role"] == "prefill", decision
    assert (asyncio.run(live_worker(mesh, "prefill", SWITCHABLE))) is not None  # it now heart-beats as prefill
    prefilled_there = [s for s in mesh.spans() if s.get("name") == "router request"
                       and (s.get("attributes") or {}).get("dispatch.prefill.worker") == SWITCHABLE]
    assert prefilled_there, "the router sent the switched worker no prefill"
    for i in (0, 5, 11):
        assert answers[i] == reference.generate(4, prompt_token_ids=prompts[i])["token_ids"]
