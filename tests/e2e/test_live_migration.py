"""Live migration, drain and failover of running requests on real engines, through the router.

Two more decode workers join the mesh's: `decode-b` (writes its partial last block every step:
`MESH_KV_DURABLE_TAIL`) and `decode-c`. Each request streams through the router while the test
commands its worker (as the placement service does) and then checks the text against one
monolithic vLLM engine's. Runs before test_mesh.py, whose last tests stop the mesh.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import pytest

from llmesh.deploy.launcher import start_service
from llmesh.wire.bus import Bus
from llmesh.wire.errors import MeshError
from llmesh.wire.messages import (
    Ack,
    MigrateCommand,
    MigrateOutcome,
    MigratePrepare,
    PlacementDecision,
    PlacementRequest,
    PlacementStatus,
    Subjects,
)

from .conftest import BLOCK_SIZE, MAX_MODEL_LEN, extra_workers, launched
from .test_mesh import MODEL, disaggregated, live_worker, token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# Where an output may part from a monolithic engine's (recomputed context, or requests batched
# together: vLLM is not batch-invariant), it may only at a near-tie: the two likeliest tokens a bf16
# step or two of the logits apart (0.03-0.06 nats here) or tied, which the random tiny model's flat
# distributions make common. A wrong KV block puts tokens nats below the likeliest.
NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def decode_workers(mesh, model_dir):
    """The mesh's decode worker, and two more started beside it (at once: engines load in parallel)."""
    base = {
        "MESH_NATS_URL": mesh.nats_url,
        "MESH_MODEL_DIR": str(model_dir),
        "MESH_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "MESH_BLOCK_SIZE": str(BLOCK_SIZE),
        "MESH_TRACE_DIR": str(mesh.trace_dir),
        "MESH_REDIS_URL": os.environ.get("MESH_REDIS_URL", ""),
    }
    # decode-b on the prefill engine's core (idle here), decode-c on the mesh decode worker's: the
    # moves between a and b, and from c to b, cross cores; between a and c they share one (fairly:
    # the launcher's children share its session, so no autogroup of one starves another's engine).
    extra = {"decode-b": {"MESH_KV_DURABLE_TAIL": "1", "MESH_CPU_CORES": "0"}, "decode-c": {"MESH_CPU_CORES": "1"}}
    with extra_workers(mesh):
        children = {
            wid: start_service("decode-worker", base | env | {"MESH_WORKER_ID": wid}, mesh.logs / f"{wid}.log")
            for wid, env in extra.items()
        }
        try:
            first = asyncio.run(live_worker(mesh, "decode"))
            give_up = time.monotonic() + 300
            for wid, child in children.items():
                while asyncio.run(live_worker(mesh, "decode", wid)) is None:
                    assert child.alive() and time.monotonic() < give_up, f"{wid} did not start"
            mesh_decode = (
                first.worker_id if first.worker_id not in extra else asyncio.run(other_decode(mesh, set(extra)))
            )
            for wid in extra:  # a first request with a long context on each: fresh engines start slowly
                asyncio.run(disaggregated(mesh, token_prompt(700, seed=7), max_tokens=4, decode_worker=wid))
            yield {"a": mesh_decode, "b": "decode-b", "c": "decode-c", "children": children}
        finally:
            for child in children.values():
                child.stop()


async def other_decode(mesh, exclude: set[str]) -> str:
    while (info := await live_worker(mesh, "decode")).worker_id in exclude:
        pass
    return info.worker_id


async def command(nats_url: str, subject: str, msg, reply_type, timeout: float = 20):
    bus = await Bus.connect(nats_url, "test-placement")
    try:
        reply, _ = await bus.request(subject, msg, reply_type, timeout=timeout)
        return reply
    finally:
        await bus.close()


async def migrate(
    mesh, request_id: str, source: str, target: str, recompute: bool = False, timeout: float = 20
) -> MigrateOutcome:
    return await command(
        mesh.nats_url,
        Subjects.migrate(source),
        MigrateCommand(migration_id=uuid.uuid4().hex, request_id=request_id, target=target, recompute=recompute),
        MigrateOutcome,
        timeout,
    )


@dataclass
class Streamed:
    request_id: str
    text: str
    token_ids: list[int]
    chunks: int
    logprobs: list[tuple[str, float]] = field(default_factory=list)  # each token's text and logprob, if asked


async def stream(
    mesh, ids: list[int], keep: int, on_token=None, logprobs: int | None = None, **sampling: Any
) -> Streamed:
    """Stream a long greedy completion through the router (with more `sampling` fields), calling
    `await on_token(n, request_id)` after the n-th chunk (while the stream waits), and hang up after
    `keep` chunks or when it returns true.
    The request generates up to the context limit, so it outlives the commands sent meanwhile."""
    async with httpx.AsyncClient(timeout=120, headers=mesh.headers) as http:
        async with http.stream(
            "POST",
            f"{mesh.url}/v1/completions",
            json={
                "model": MODEL,
                "prompt": ids,
                "max_tokens": MAX_MODEL_LEN - len(ids) - 8,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            | ({"logprobs": logprobs} if logprobs is not None else {})
            | sampling,
        ) as resp:
            assert resp.status_code == 200, await resp.aread()
            got = Streamed(resp.headers["x-request-id"], "", [], 0)
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                got.text += event["choices"][0]["text"]
                got.token_ids += event["choices"][0]["token_ids"]
                if logprobs is not None:
                    asked = event["choices"][0]["logprobs"]
                    got.logprobs += zip(asked["tokens"], asked["token_logprobs"])
                got.chunks += 1
                if (on_token is not None and await on_token(got.chunks, got.request_id)) or got.chunks == keep:
                    return got
    raise AssertionError(f"the stream ended after {got.chunks} chunks")


def resumed_after(since: list[int], pause_s: float = 1.0, then: int = 20):
    """For the end of an `on_token`: once `since` holds a chunk number (a worker was killed, say), true
    from `then` chunks after the first later chunk that came `pause_s` or more after the one before
    it (the stream resumed elsewhere)."""
    last, resumed = [time.monotonic()], []

    def seen(n: int) -> bool:
        now = time.monotonic()
        if since and n > since[0] and not resumed and now - last[0] >= pause_s:
            resumed.append(n)
        last[0] = now
        return bool(resumed) and n >= resumed[0] + then

    return seen


def same_tokens(tokens: list[int], expected: dict, near_tie: float, name: str, detail=lambda: "") -> bool:
    """True when `tokens` equal the reference's output (`expected`, with its `top`) token for token;
    False when they part where `tokens` took one of the reference's likeliest tokens within `near_tie`
    nats of its choice (printed); else an AssertionError naming `name` (and `detail()`)."""
    if tokens == expected["token_ids"]:
        return True
    at = next(
        (i for i, (a, b) in enumerate(zip(tokens, expected["token_ids"])) if a != b),
        min(len(tokens), len(expected["token_ids"])),
    )
    likeliest = expected["top"][at] if at < len(expected["top"]) else {}
    if (
        at < len(tokens)
        and str(tokens[at]) in likeliest
        and likeliest[str(expected["token_ids"][at])] - likeliest[str(tokens[at])] <= near_tie
    ):
        print(f"{name} parted from the reference at token {at}, a near-tie: {likeliest}")
        return False
    raise AssertionError(
        f"{name} differs at token {at}: {tokens[at : at + 5]} != {expected['token_ids'][at : at + 5]} "
        f"(the reference's likeliest there: {likeliest}); {detail()}"
    )


def assert_exact(mesh, reference, ids: list[int], streamed: Streamed, near_tie: float = 0.0, **sampling: Any) -> None:
    """The streamed tokens (a token or more each chunk: deltas merge while a reader lags) and a
    monolithic engine's output (with the same `sampling` fields) agree token for token, and so does
    the text. With `near_tie`, they may part where the stream took a token within that many nats of the
    reference's choice (recomputed KV is not bit-identical to decoded KV)."""
    expected = reference.generate(len(streamed.token_ids), prompt_token_ids=ids, top=True, ignore_eos=True, **sampling)
    assert len(streamed.token_ids) >= streamed.chunks
    if not same_tokens(
        streamed.token_ids,
        expected,
        near_tie,
        streamed.request_id,
        lambda: f"its resumed decodes (worker, after, kv): {resumes(mesh, streamed.request_id, 99, 3)}",
    ):
        return
    common = min(len(streamed.text), len(expected["text"]))  # a last, incomplete character may be held back
    assert streamed.text[:common] == expected["text"][:common], (streamed.request_id, streamed.text, expected["text"])
    if streamed.logprobs:  # texts and values: those of the engine that made the output so far count too
        assert streamed.logprobs == [(step[0][2], step[0][1]) for step in expected["steps"]], streamed.request_id


def resumes(mesh, request_id: str, count: int, wait_s: float = 15) -> list[tuple[str, int, str]]:
    """(worker, output tokens it resumed after, where its KV came from) of each decode of the request
    that resumed one (a hand-over or a failover), once `count` are written (spans go out in batches)."""
    give_up = time.monotonic() + wait_s
    while True:
        found = sorted(
            (a["worker.id"], a["decode.resumed_at"], a["decode.kv"])
            for a in (span["attributes"] for span in mesh.spans())
            if a.get("request.id") == request_id and a.get("decode.resumed_at", 0) > 1
        )
        if len(found) >= count or time.monotonic() > give_up:
            return found
        time.sleep(0.5)


def one_trace(mesh, request_id: str, resumed: int, wait_s: float = 15, whole: bool = True) -> list[dict]:
    """The request's trace, rooted at the router's request span, once its `resumed` decode legs after a
    hand-over or a failover (those `resumes` reads) are in: each of them is in it, every parent is in
    it (unless not `whole`: a worker SIGKILLed mid-leg never ends, so never exports, its leg's span),
    and a migration command the request's worker accepted, in a trace of its own, links to it."""
    resumes(mesh, request_id, resumed, wait_s)
    give_up = time.monotonic() + wait_s
    while True:  # a parent ends, so is exported, after its children: it may come in a later batch
        spans = mesh.spans()
        named = [s for s in spans if s["attributes"].get("request.id") == request_id]
        (root,) = [s for s in named if s["name"] == "router request"]
        trace_id = root["context"]["trace_id"]
        trace = [s for s in spans if s["context"]["trace_id"] == trace_id]
        by_id = {s["context"]["span_id"]: s for s in trace}
        roots = [s["name"] for s in trace if s["parent_id"] not in by_id]
        if (roots == ["router request"] if whole else "router request" in roots) or time.monotonic() > give_up:
            break
        time.sleep(0.5)
    assert roots == ["router request"] if whole else "router request" in roots, roots
    legs = [s for s in named if s["attributes"].get("decode.resumed_at", 0) > 1]
    assert len(legs) >= resumed and all(s["context"]["trace_id"] == trace_id for s in legs), [
        (s["name"], s["context"]["trace_id"]) for s in legs
    ]
    for s in named:
        if s["context"]["trace_id"] != trace_id and s["attributes"].get("migration.accepted"):
            assert any(link["context"]["trace_id"] == trace_id for link in s.get("links") or []), (
                f"{s['name']} is in another trace, unlinked"
            )
    return trace


async def first_outcome(mesh, request_id: str, workers: dict, target: str) -> MigrateOutcome:
    """The outcome from the worker that runs the request (the others do not know it)."""
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        for source in (workers["a"], workers["b"], workers["c"]):
            outcome = await migrate(mesh, request_id, source, target)
            if "not decoding" not in outcome.reason:
                return outcome
        await asyncio.sleep(0.02)
    raise AssertionError(f"no worker runs {request_id}")


async def move(mesh, request_id: str, workers: dict, target_for, recompute: bool = False) -> str:
    """Migrate the request from whichever decode worker runs it to `target_for(source)`, retrying
    until one accepts (the decode may not have started yet); the target."""
    give_up, reasons = time.monotonic() + 30, {}
    while time.monotonic() < give_up:
        for source in (workers["a"], workers["b"], workers["c"]):
            target = target_for(source)
            outcome = await migrate(mesh, request_id, source, target, recompute)
            if outcome.accepted or outcome.reason == "the target is the source":
                return target
            reasons[source] = outcome.reason
        await asyncio.sleep(0.02)
    raise AssertionError(f"no worker accepted migrating {request_id}; last reasons: {reasons}")


def elsewhere(there: str, back: str):
    """Go to `there`, or to `back` from `there` (so that repeated moves go back and forth)."""
    return lambda source: back if source == there else there


# ---- exactness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [BLOCK_SIZE - 3, BLOCK_SIZE - 1, 2 * BLOCK_SIZE, 700])
def test_a_request_migrated_mid_stream_is_exact(mesh, reference, decode_workers, prompt_len):
    """One hand-over a few tokens in: with prompts just under and on block boundaries, the switch
    lands on and around them (the source stops at its next step after the hand-shake)."""
    a, b = decode_workers["a"], decode_workers["b"]
    ids = token_prompt(prompt_len, seed=prompt_len + 11)
    moved = []

    async def on_token(n, request_id):
        if n == 2:
            moved.append(await move(mesh, request_id, decode_workers, elsewhere(b, a)))

    streamed = asyncio.run(stream(mesh, ids, 150, on_token))
    assert moved
    assert_exact(mesh, reference, ids, streamed)


def test_repeated_migrations_there_and_back_are_exact(mesh, reference, decode_workers):
    a, b = decode_workers["a"], decode_workers["b"]
    ids = token_prompt(300, seed=303)
    moved, moved_at = [], []

    async def on_token(n, request_id):
        # A -> B -> A -> B, one move after the other (the tiny model decodes a few thousand tokens a
        # second here: chunks counted from the start could come after the request's end); hang up a
        # second after the last, once its hand-over is surely done
        if n in (3, 4, 5):
            moved.append(await move(mesh, request_id, decode_workers, elsewhere(b, a)))
            moved_at.append(time.monotonic())
        return len(moved) == 3 and time.monotonic() > moved_at[-1] + 1.0

    # penalties on the whole output, a grammar and seeded sampling: each engine counts the output before it,
    # the end of its prompt, and its grammar (one that never ends, so the output outlives the moves) and its
    # random stream start past it
    fields = {
        "temperature": 0.8,
        "seed": 11,
        "frequency_penalty": 0.2,
        "presence_penalty": 0.3,
        "structured_outputs": {"grammar": "root ::= [a-z ] root"},
    }
    streamed = asyncio.run(stream(mesh, ids, 100_000, on_token, logprobs=5, **fields))
    assert len(moved) == 3 and moved[0] != moved[1] and moved[0] == moved[2]
    assert set(streamed.text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert_exact(mesh, reference, ids, streamed, **fields)
    hand_overs = resumes(mesh, streamed.request_id, 3)
    assert len(hand_overs) == 3 and {kv for _, _, kv in hand_overs} == {"handle"}, hand_overs
    trace = one_trace(mesh, streamed.request_id, 3)  # the three hand-overs, in the request's trace
    assert sum(s["name"] == "router.decode" for s in trace) >= 3
    accepted = [
        s
        for s in mesh.spans()
        if s["name"] == "decode-worker migrate"
        and s["attributes"].get("request.id") == streamed.request_id
        and s["attributes"]["migration.accepted"]
    ]
    assert len(accepted) == 3  # each linked to the request's trace (one_trace)
    # the source has its partial last block written every step once the hand-shake begins, so a
    # hand-over need not wait for the export at the stop (which stays as the fallback: it was
    # used in about one hand-over in ten in these tests)
    tails = [
        a["kv.tail"]
        for a in (span["attributes"] for span in mesh.spans())
        if a.get("request.id") == streamed.request_id and "kv.tail" in a
    ]
    assert len(tails) == 3 and "durable" in tails, tails


def prefetches(mesh, request_ids: set[str], count: int, wait_s: float = 15) -> list[dict]:
    """The targets' `migration.prefetch` spans for these requests (attributes, and `seconds`), once `count` are in."""
    give_up = time.monotonic() + wait_s
    while True:
        found = [
            s["attributes"] | {"seconds": span_seconds(s)}
            for s in mesh.spans()
            if s["name"] == "migration.prefetch" and s["attributes"].get("request.id") in request_ids
        ]
        if len(found) >= count or time.monotonic() > give_up:
            return found
        time.sleep(0.5)


def span_seconds(span: dict) -> float:
    start, end = (datetime.fromisoformat(span[k].replace("Z", "+00:00")) for k in ("start_time", "end_time"))
    return (end - start).total_seconds()


def test_prefetches_start_at_once_while_the_source_decodes_on_the_same_core(mesh, reference, decode_workers):
    """Three streams at once, each moved four times between a and c, whose engines share a core. The
    target's prefetch loads what the store holds while the source decodes on: none may wait out its
    limit (the target then agrees without it and the hand-over loads everything). Each worker in a
    session of its own, the kernel let the source's engine starve the target's until the source
    stopped, which it did only once the target answered: 5 to 7 of 12 prefetches took the whole 2 s."""
    a, c = decode_workers["a"], decode_workers["c"]
    prompts = [token_prompt(n, seed=n + 41) for n in (2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 1, 4 * BLOCK_SIZE - 1)]
    moves: dict[str, list[str]] = {}

    async def moved_four_times(ids: list[int]) -> Streamed:
        moved, moved_at = [], []

        async def on_token(n, request_id):
            # a move every hundred chunks or so while the other streams decode on both engines; hang up a
            # second after the fourth, once its hand-over is surely done
            if len(moved) < 4 and n >= 3 + 100 * len(moved):
                moved.append(await move(mesh, request_id, decode_workers, elsewhere(c, a)))
                moved_at.append(time.monotonic())
                moves[request_id] = moved
            return len(moved) == 4 and time.monotonic() > moved_at[-1] + 1.0

        return await stream(mesh, ids, 100_000, on_token)

    async def run() -> list[Streamed]:
        return await asyncio.gather(*(moved_four_times(ids) for ids in prompts))

    streams = asyncio.run(run())
    for streamed in streams:
        assert len(moves[streamed.request_id]) == 4, moves
    found = prefetches(mesh, {s.request_id for s in streams}, 12)
    print("prefetches (s):", sorted(round(p["seconds"], 3) for p in found))  # docs/benchmarks.md, with -s
    waited = [p for p in found if p.get("kv.prefetch_timed_out") and p.get("kv.stored")]
    assert len(found) == 12 and not waited, (
        f"{len(waited)} of {len(found)} prefetches waited out their limit while the store held the blocks: {waited}"
    )
    for ids, streamed in zip(prompts, streams):
        assert_exact(mesh, reference, ids, streamed, near_tie=NEAR_TIE)  # three streams batched together


def test_a_refused_migration_leaves_the_request_running_exactly(mesh, reference, decode_workers):
    ids = token_prompt(200, seed=202)
    outcomes = []

    async def on_token(n, request_id):
        if n == 2:
            outcomes.append(await first_outcome(mesh, request_id, decode_workers, "decode-nowhere"))

    streamed = asyncio.run(stream(mesh, ids, 40, on_token))
    assert not outcomes[0].accepted and "refused" in outcomes[0].reason
    assert_exact(mesh, reference, ids, streamed)


def test_a_target_that_fails_before_taking_over_hands_back_to_the_source(mesh, reference, decode_workers):
    """The target agrees (and then is gone before the hand-over arrives): the source resumes."""
    ids = token_prompt(260, seed=262)

    async def on_token(n, request_id):
        if n == 2:
            ghost = await Bus.connect(mesh.nats_url, "ghost-decode")
            try:

                async def agree(msg: MigratePrepare, blob):
                    return Ack()

                await ghost.serve(Subjects.migrate_in("decode-ghost"), agree)
                outcome = await first_outcome(mesh, request_id, decode_workers, "decode-ghost")
            finally:
                await ghost.close()  # dies before the router hands the request over
            assert outcome.accepted

    streamed = asyncio.run(stream(mesh, ids, 40, on_token))
    assert_exact(mesh, reference, ids, streamed)


def test_a_recompute_migration_gives_the_same_text(mesh, reference, decode_workers):
    """The baseline the benchmark compares with: the target computes the context again."""
    a, b = decode_workers["a"], decode_workers["b"]
    ids = token_prompt(150, seed=151)

    async def on_token(n, request_id):
        if n == 2:
            await move(mesh, request_id, decode_workers, elsewhere(b, a), recompute=True)

    streamed = asyncio.run(stream(mesh, ids, 96, on_token))
    assert_exact(mesh, reference, ids, streamed)


# ---- drain and failover (last: they stop decode-c and decode-b) -------------------------------------------


def test_drain_moves_running_requests_away_and_the_worker_exits(mesh, reference, decode_workers):
    """`drain` through the placement service (the operator's CLI does the same): the worker takes
    no new requests, placement migrates its running one away, and the worker exits cleanly."""
    c = decode_workers["c"]
    ids = token_prompt(400, seed=404)
    moved, moved_at = [], []  # requests placement moved off the drained worker; the chunk by which it had

    async def on_decision(decision: PlacementDecision, blob) -> None:
        if (decision.kind, decision.reason, decision.detail.get("outcome")) == ("migrate", "drain", "accepted"):
            moved.append(decision.detail["request_id"])

    async def on_token(n, request_id):
        if n == 2:
            await move(mesh, request_id, decode_workers, lambda source: c)  # onto the worker to drain
        if n == 5:
            status = await command(
                mesh.nats_url, Subjects.PLACEMENT, PlacementRequest(op="drain", worker_id=c), PlacementStatus
            )
            assert "drains" in status.message, status.message
        if request_id in moved and not moved_at:
            moved_at.append(n)
        return bool(moved_at) and n >= moved_at[0] + 20

    async def run() -> Streamed:
        events = await Bus.connect(mesh.nats_url, "test-drain-events")
        try:
            await events.serve(Subjects.PLACEMENT_EVENTS, on_decision)
            return await stream(mesh, ids, 100_000, on_token)
        finally:
            await events.close()

    streamed = asyncio.run(run())
    moved_off = [r for r in resumes(mesh, streamed.request_id, 2) if r[0] != c]
    assert moved_off and moved_off[-1][2] == "handle", resumes(mesh, streamed.request_id, 2, wait_s=0)
    assert_exact(mesh, reference, ids, streamed)
    child = decode_workers["children"]["decode-c"]
    child.proc.wait(30)
    assert child.proc.returncode == 0


def test_sigkill_of_a_migrations_source_mid_hand_shake_resumes_from_the_store_exactly(mesh, reference, decode_workers):
    """decode-b, which writes its partial last block every step, is SIGKILLed while its hand-shake
    with a target is under way (the target has the request to prepare): the migration is off, the
    router takes the request over to another worker, which loads every token's KV but the last and
    computes only that, as on the dead worker. The target is stopped (SIGSTOP) while a command is out,
    so that it cannot finish the hand-over before the source dies; it wakes to a prepare whose
    hand-over never comes."""
    a, b = decode_workers["a"], decode_workers["b"]
    ids = token_prompt(330, seed=333)
    pid = decode_workers["children"]["decode-b"].pid
    [target_pid] = [p for p, program in launched(mesh).items() if "llmesh_decode" in program]
    commands, killed, killed_at = [], [], []
    resumed = resumed_after(killed_at)

    async def on_token(n, request_id):
        if n == 2:
            await move(mesh, request_id, decode_workers, lambda source: b)
        if n == 10:
            spy = await Bus.connect(mesh.nats_url, "test-spy")
            try:

                async def kill_the_source(msg: MigratePrepare, blob) -> None:  # a answers; b dies meanwhile
                    os.killpg(pid, signal.SIGKILL)
                    killed.append(msg.migration_id)

                await spy.serve(Subjects.migrate_in(a), kill_the_source)
                give_up = time.monotonic() + 10
                while True:
                    os.kill(target_pid, signal.SIGSTOP)
                    try:
                        command = asyncio.create_task(migrate(mesh, request_id, b, a, timeout=5))
                        while not killed and not command.done():
                            await asyncio.sleep(0.001)
                    finally:
                        os.kill(target_pid, signal.SIGCONT)
                    if killed:
                        break
                    outcome = command.result()  # refused before any hand-shake: b has not taken the request yet
                    assert "not decoding" in outcome.reason and time.monotonic() < give_up, outcome
                    await asyncio.sleep(0.02)
                commands.append(command)
                killed_at.append(n)
            finally:
                await spy.close()
        return resumed(n)

    async def run() -> tuple[Streamed, list]:
        streamed = await stream(mesh, ids, 100_000, on_token)
        return streamed, await asyncio.gather(*commands, return_exceptions=True)

    streamed, (outcome,) = asyncio.run(run())
    assert killed
    assert isinstance(outcome, MeshError), outcome  # the source died before it could answer
    taken_over = [r for r in resumes(mesh, streamed.request_id, 2) if r[0] != b]
    assert taken_over and taken_over[-1][1] >= 10, resumes(mesh, streamed.request_id, 2, wait_s=0)
    assert_exact(mesh, reference, ids, streamed)
    one_trace(mesh, streamed.request_id, 1, whole=False)  # the leg after the failover
