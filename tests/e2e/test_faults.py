"""Faults under load, on the session mesh: nats-server and redis-server, a kv-store shard mid-transfer,
the router (with a second one serving), the length predictor and placement, each SIGKILLed. The
launcher restarts what died where it was; every request a live router accepted either completes (its
tokens greedy under a monolithic engine, but for batching's near-ties) or gets a typed error within
its deadline; the mesh serves again within seconds, and no other service process is restarted.

(Run after every other e2e test but before those that kill the mesh's workers: if the mesh did not
come back, the tests after it would fail too.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from llmesh.deploy.launcher import free_port, start_service, wait_healthy
from llmesh.wire.bus import Bus
from llmesh.wire.errors import MeshError
from llmesh.wire.messages import LengthPrediction, LengthPredictRequest, PlacementRequest, PlacementStatus, Subjects
from llmesh.wire.secrets import without_userinfo

from .conftest import launched
from .test_live_migration import NEAR_TIE
from .test_mesh import MODEL, kv_stats, live_worker, token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.breaks_the_mesh]
CONCURRENT, OUTPUT = 6, 400
BACK_WITHIN_S = 20


def infrastructure(mesh, program: str) -> int:
    found = [pid for pid, cmd in launched(mesh).items() if program in cmd]
    assert len(found) == 1, launched(mesh)
    return found[0]


async def stream(
    http: httpx.AsyncClient,
    mesh,
    ids: list[int] | str,
    started: asyncio.Event,
    *,
    url: str | None = None,
    output: int = OUTPUT,
    request_ids: list[str] | None = None,
    first_token: asyncio.Event | None = None,
) -> tuple[list[int], dict | None]:
    """A greedy streamed completion through the router at `url` (the mesh's): its token ids, and the
    error that ended it, if one did. `started` is set at its 20th token, `first_token` at its first;
    its request id is added to `request_ids`."""
    tokens: list[int] = []
    async with http.stream(
        "POST",
        f"{url or mesh.url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": ids,
            "max_tokens": output,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        },
    ) as resp:
        if request_ids is not None:
            request_ids.append(resp.headers.get("X-Request-Id", ""))
        if resp.status_code != 200:
            return tokens, json.loads(await resp.aread())["error"]
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return tokens, event["error"]
            tokens += event["choices"][0].get("token_ids") or []
            if tokens and first_token is not None:
                first_token.set()
            if len(tokens) >= 20:
                started.set()
    return tokens, None


def check_outputs(
    reference, prompts: list[list[int]], results: list[tuple[list[int], dict | None]], output: int = OUTPUT
) -> None:
    """Every stream completed greedy under the reference (but for near-ties) or ended with a typed error
    in OpenAI's shape."""
    for ids, (tokens, error) in zip(prompts, results):
        if error is not None:
            assert error["message"] and error["code"] not in ("internal_error", "timeout"), error
            continue
        assert len(tokens) == output
        gaps = reference.greedy_gaps(ids, tokens)
        assert max(gaps) <= NEAR_TIE, f"a token {max(gaps):.3f} nats below the likeliest"


def service_pids(mesh) -> dict[int, str]:
    return {pid: cmd for pid, cmd in launched(mesh).items() if "-m llmesh" in cmd}


async def restarted(mesh, program: str, killed: int, within_s: float = 60) -> int:
    """The pid of `program` once the launcher has started it again in place of `killed`."""
    give_up = time.monotonic() + within_s
    while True:
        found = [pid for pid, cmd in launched(mesh).items() if program in cmd and pid != killed]
        if found:
            return found[0]
        assert time.monotonic() < give_up, f"the launcher did not start {program} again within {within_s}s"
        await asyncio.sleep(0.2)


async def wait_serving(mesh, since: float) -> float:
    """Seconds from `since` until a completion succeeds again."""
    async with httpx.AsyncClient(timeout=10, headers=mesh.headers) as http:
        while True:
            try:
                resp = await http.post(
                    f"{mesh.url}/v1/completions", json={"model": MODEL, "prompt": "back?", "max_tokens": 2}
                )
                if resp.status_code == 200:
                    return time.monotonic() - since
            except httpx.HTTPError:
                pass
            assert time.monotonic() - since < BACK_WITHIN_S, f"the mesh did not serve again within {BACK_WITHIN_S}s"
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("program", ["nats-server", "redis-server"])
def test_an_infrastructure_server_killed_mid_load_loses_no_request_and_the_mesh_serves_again(mesh, reference, program):
    victim = infrastructure(mesh, program)
    services = service_pids(mesh)
    prompts = [token_prompt(200, seed=4000 + 10 * len(program) + i) for i in range(CONCURRENT)]

    async def go():
        started = [asyncio.Event() for _ in prompts]
        async with httpx.AsyncClient(timeout=150, headers=mesh.headers) as http:
            tasks = [asyncio.create_task(stream(http, mesh, ids, s)) for ids, s in zip(prompts, started)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            back_after = await wait_serving(mesh, killed)
            # well within the requests' deadline (120 s): a stream whose replies were lost in the outage is
            # sent again once the router reconnects, instead of waiting for the deadline (it did, before)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return back_after, results

    back_after, results = asyncio.run(go())
    check_outputs(reference, prompts, results)
    assert infrastructure(mesh, program) != victim
    assert service_pids(mesh) == services  # none restarted
    print(
        f"{program}: served again {back_after:.1f} s after the kill; "
        f"{sum(e is None for _, e in results)}/{len(results)} streams completed, errors: "
        f"{[e['code'] for _, e in results if e is not None]}"
    )


def test_a_kv_store_killed_mid_transfer_is_recomputed_around_and_comes_back_from_its_ssd_tier(mesh, reference):
    """Prompts of 8 blocks arrive 50 ms apart; the store is SIGKILLed as the first one's first token comes
    out, while the others' prefills are putting their KV and its decode is loading it. Decode recomputes
    what it cannot load; the launcher starts the shard again, which re-indexes its SSD tier."""
    killed = infrastructure(mesh, "llmesh_kvstore")
    services = {pid: cmd for pid, cmd in service_pids(mesh).items() if pid != killed}
    prompts = [token_prompt(1000, seed=6000 + i) for i in range(CONCURRENT)]

    async def go():
        flushed = await kv_stats(mesh, "flush")  # what the store holds so far goes to SSD, to come back with it
        first_token = asyncio.Event()
        async with httpx.AsyncClient(timeout=150, headers=mesh.headers) as http:
            tasks = []
            for ids in prompts:
                tasks.append(asyncio.create_task(stream(http, mesh, ids, asyncio.Event(), first_token=first_token)))
                await asyncio.sleep(0.05)
            await asyncio.wait_for(first_token.wait(), 60)
            os.killpg(killed, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        await restarted(mesh, "llmesh_kvstore", killed)
        give_up = time.monotonic() + 30
        while True:
            try:
                return flushed, await kv_stats(mesh, timeout=2), results
            except MeshError:
                assert time.monotonic() < give_up, "the restarted kv-store does not answer"
                await asyncio.sleep(0.2)

    flushed, back, results = asyncio.run(go())
    check_outputs(reference, prompts, results)
    assert sum(error is None for _, error in results) == len(prompts)  # nothing needs the store to complete
    assert back.ssd_chunks >= flushed.ssd_chunks > 0  # its SSD tier, re-indexed
    assert {pid: cmd for pid, cmd in service_pids(mesh).items() if "llmesh_kvstore" not in cmd} == services


def test_a_router_killed_mid_load_costs_only_its_own_streams_and_comes_back(mesh, reference):
    """Two routers over the same workers; one is SIGKILLed mid-stream. The other's streams complete,
    exact; the workers stop the dead router's requests at once (NATS finds nobody reading their
    replies) instead of decoding them to the end; the launcher starts the router again."""
    secrets_dir = mesh.logs.parent / "secrets"
    port = free_port()
    second = start_service(
        "router",
        {
            "MESH_NATS_URL": without_userinfo(mesh.nats_url),
            "MESH_SECRETS_DIR": str(secrets_dir),
            "MESH_PORT": str(port),
            "MESH_REQUEST_TIMEOUT_S": "120",
        },
        mesh.logs / "router-second.log",
        "router-second",
    )
    second_url = f"http://127.0.0.1:{port}"
    killed = infrastructure(mesh, "llmesh_router")
    services = {pid: cmd for pid, cmd in service_pids(mesh).items() if pid != killed}
    output = 2000  # a few seconds of decoding for 6 streams: the kill lands well before the ends
    prompts = [token_prompt(200, seed=7000 + i) for i in range(CONCURRENT)]
    try:
        wait_healthy(second_url, 30, [second])

        async def go():
            started = [asyncio.Event() for _ in prompts]
            orphans: list[str] = []
            async with httpx.AsyncClient(timeout=150, headers=mesh.headers) as http:

                async def through(i, ids):
                    on_first = i % 2 == 0
                    try:
                        return await stream(
                            http,
                            mesh,
                            ids,
                            started[i],
                            url=mesh.url if on_first else second_url,
                            output=output,
                            request_ids=orphans if on_first else None,
                        )
                    except httpx.HTTPError as exc:
                        return [], {"code": "connection_lost", "message": repr(exc)}

                tasks = [asyncio.create_task(through(i, ids)) for i, ids in enumerate(prompts)]
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
                os.killpg(killed, signal.SIGKILL)
                at = time.monotonic()
                while True:  # the decode worker drops the dead router's requests
                    heartbeat = await live_worker(mesh, "decode")  # None: one missed under load, ask again
                    if heartbeat is not None and not {r.request_id for r in heartbeat.requests} & set(orphans):
                        stopped_after = time.monotonic() - at
                        break
                    assert time.monotonic() - at < 8, "the decode worker still runs the dead router's requests"
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            await restarted(mesh, "llmesh_router", killed)
            return stopped_after, results, await wait_serving(mesh, at)

        stopped_after, results, back_after = asyncio.run(go())
        survivors = [r for i, r in enumerate(results) if i % 2]
        assert all(error is None for _, error in survivors), survivors
        check_outputs(reference, prompts[1::2], survivors, output)
        assert all(error is not None for i, (_, error) in enumerate(results) if i % 2 == 0)  # its clients saw it die
        assert {pid: cmd for pid, cmd in service_pids(mesh).items() if "llmesh_router" not in cmd} == services
        print(
            f"router: its requests left the decode worker {stopped_after:.1f} s after the kill; "
            f"served again after {back_after:.1f} s"
        )
    finally:
        second.stop()
        wait_healthy(mesh.url, 60, [])  # the next test needs the launcher's router back, even after a failure


def test_without_the_length_predictor_and_placement_the_mesh_serves_exactly_until_they_are_back(mesh, reference):
    """Text prompts (token ids are not predicted), one at a time, so each output must equal a solo run's."""
    predictor, placement = infrastructure(mesh, "llmesh_lengthpred"), infrastructure(mesh, "llmesh_placement")
    prompts = [f"Question {i}: what is the weather like on the coast in winter, and why?" for i in range(4)]

    async def predictions(outcome: str) -> float:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"{mesh.url}/metrics")).text
        line = next(
            (
                line
                for line in text.splitlines()
                if line.startswith(f'llmesh_request_length_predictions_total{{outcome="{outcome}"}}')
            ),
            "",
        )
        return float(line.split()[-1]) if line else 0.0

    async def go():
        before = await predictions("unavailable")
        for pid in (predictor, placement):
            os.killpg(pid, signal.SIGKILL)
        async with httpx.AsyncClient(timeout=150, headers=mesh.headers) as http:
            results = [await stream(http, mesh, text, asyncio.Event(), output=100) for text in prompts]
        unavailable = await predictions("unavailable") - before
        for program, pid in (("llmesh_lengthpred", predictor), ("llmesh_placement", placement)):
            await restarted(mesh, program, pid)
        bus = await Bus.connect(mesh.nats_url, "test-back")
        try:
            give_up = time.monotonic() + 90
            while True:  # both answer again
                try:
                    await bus.request(
                        Subjects.LENGTH_PREDICT,
                        LengthPredictRequest(request_id="back", prompt="hi"),
                        LengthPrediction,
                        timeout=2,
                    )
                    await bus.request(Subjects.PLACEMENT, PlacementRequest(op="status"), PlacementStatus, timeout=2)
                    break
                except MeshError:
                    assert time.monotonic() < give_up, "the length predictor or placement did not come back"
                    await asyncio.sleep(0.5)
        finally:
            await bus.close()
        return results, unavailable

    results, unavailable = asyncio.run(go())
    assert all(error is None for _, error in results), results
    for text, (tokens, _) in zip(prompts, results):
        assert tokens == reference.generate(100, prompt=text, ignore_eos=True)["token_ids"]
    assert unavailable >= 1  # the predictor really was gone while they ran
