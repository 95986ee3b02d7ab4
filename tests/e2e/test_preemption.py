"""Preemption under KV pressure (AdaptiveLLM's swap or recompute), on real engines.

Two decode workers with too few KV blocks for the requests they are given at once: vLLM preempts
one, and when it resumes, one worker's connector loads its KV back from the kv-store (swap), the
other's lets vLLM compute it again (recompute). Either way the output equals a monolithic engine's
(but at near-ties, where batching alone parts vLLM from its solo runs), and each worker counts its
choices in its heartbeat. (Which one `auto` picks is the cost model's,
tested as a table in tests/unit/test_preemption_policy.py.)

Last, one of them is SIGKILLed mid-stream: without `MESH_KV_DURABLE_TAIL` (test_live_migration.py
tests it with), the request resumes elsewhere from the full blocks in the store.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from llmesh.deploy.launcher import engine_cores, start_service

from .conftest import BLOCK_SIZE, MAX_MODEL_LEN, extra_workers
from .test_live_migration import NEAR_TIE, assert_exact, move, other_decode, resumed_after, resumes, stream
from .test_mesh import disaggregated, live_worker, token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

KV_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE + 1  # one request of the longest context fits; three of these do not
# 8 blocks each at first, 96 in all: more than the worker's 65, so some wait, and as they start they
# take the blocks that preempted requests freed
PROMPT, OUTPUT, CONCURRENT = 1000, 1000, 12


@pytest.fixture(scope="module")
def small_kv_workers(mesh, model_dir):
    """A decode worker per choice, each with `KV_BLOCKS` blocks (started at once: engines load in parallel)."""
    base = {
        "MESH_NATS_URL": mesh.nats_url,
        "MESH_MODEL_DIR": str(model_dir),
        "MESH_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "MESH_BLOCK_SIZE": str(BLOCK_SIZE),
        "MESH_KV_BLOCKS": str(KV_BLOCKS),
        "MESH_TRACE_DIR": str(mesh.trace_dir),
    } | engine_cores().get("decode-worker", {})  # the cores `make run` gives a decode worker
    with extra_workers(mesh):
        children = {
            choice: start_service(
                "decode-worker",
                base | {"MESH_WORKER_ID": f"decode-{choice}", "MESH_KV_PREEMPTION": choice},
                mesh.logs / f"decode-{choice}.log",
            )
            for choice in ("swap", "recompute")
        }
        try:
            give_up = time.monotonic() + 300
            for choice, child in children.items():
                while asyncio.run(live_worker(mesh, "decode", f"decode-{choice}")) is None:
                    assert child.alive() and time.monotonic() < give_up, f"decode-{choice} did not start"
            yield {choice: f"decode-{choice}" for choice in children} | {"children": children}
        finally:
            for child in children.values():
                child.stop()


@pytest.mark.parametrize("choice", ["swap", "recompute"])
def test_preempted_requests_resume_exactly(mesh, reference, small_kv_workers, choice):
    """Rounds of requests at once until the worker has had a choice to make (a resumed request whose
    blocks vLLM's own prefix cache no longer holds); every output token is greedy under a monolithic
    engine given the tokens before it (but for batching's near-ties)."""
    worker = small_kv_workers[choice]
    for round in range(5):
        prompts = [token_prompt(PROMPT, seed=900 + 10 * round + i) for i in range(CONCURRENT)]

        async def together():
            # every decode leg starts once all prompts are prefilled: new prompts prefill one or two at a
            # time under load, and their decodes, arriving 2 s apart, never filled the worker (in the full
            # suite the swap worker, given new prompts, had at most 3 at once; the recompute worker, given
            # the same prompts after it, found them stored and had all 12 at once)
            prefilled = asyncio.Barrier(CONCURRENT)
            return await asyncio.gather(
                *(disaggregated(mesh, ids, OUTPUT, decode_worker=worker, between=prefilled.wait) for ids in prompts)
            )

        outputs = asyncio.run(together())
        for i, (ids, tokens) in enumerate(zip(prompts, outputs)):
            gaps = reference.greedy_gaps(ids, tokens)
            worst = max(range(len(gaps)), key=gaps.__getitem__)
            assert gaps[worst] <= NEAR_TIE, (
                f"round {round} request {i}: output token {worst} ({tokens[worst]}) "
                f"is {gaps[worst]:.3f} nats below the likeliest there"
            )
        counted = asyncio.run(live_worker(mesh, "decode", worker)).preemptions
        if counted:
            break
    assert counted.get(choice, 0) >= 1 and set(counted) == {choice}, counted


def test_sigkill_without_a_durable_tail_resumes_from_the_full_blocks_exactly_but_for_near_ties(
    mesh, reference, small_kv_workers
):
    """The worker that takes the request over loads its full blocks from the store and computes the
    tokens after them again (up to a block) in one pass: greedy output equals a monolithic engine's, but
    a recomputed token at a near-tie may come out as the other of the two (then the outputs part)."""
    victim, swap = small_kv_workers["recompute"], small_kv_workers["swap"]
    workers = {"a": asyncio.run(other_decode(mesh, {victim, swap})), "b": victim, "c": swap}
    ids = token_prompt(330, seed=335)
    killed_at = []
    resumed = resumed_after(killed_at)

    async def on_token(n, request_id):
        if n == 2:
            await move(mesh, request_id, workers, lambda source: victim)
        if n == 100:  # 430 tokens or more (tokens pile up while `move` holds the reader)
            os.killpg(small_kv_workers["children"]["recompute"].pid, signal.SIGKILL)
            killed_at.append(n)
        return resumed(n)

    streamed = asyncio.run(stream(mesh, ids, 100_000, on_token))
    taken_over = [r for r in resumes(mesh, streamed.request_id, 2) if r[0] != victim]
    assert taken_over and taken_over[-1][1] >= 100, resumes(mesh, streamed.request_id, 2, wait_s=0)
    assert_exact(mesh, reference, ids, streamed, near_tie=NEAR_TIE)
