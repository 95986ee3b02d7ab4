"""The router as a process (uvicorn, real HTTP) on a real nats-server, pushed past capacity as a client
would push it; its workers speak the mesh's protocol from this test (heartbeats, prefill, decode,
refusals), so each can be made as full as a scenario needs."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from llmesh.deploy.launcher import Child, free_port, start_nats, wait_healthy
from llmesh.wire.bus import Bus
from llmesh.wire.errors import AtCapacity
from llmesh.wire.messages import PrefillResult, Subjects, TokenDelta, WorkerInfo

pytestmark = pytest.mark.timeout(120)
FINGERPRINT = "f" * 32
HEARTBEAT_S = 0.25


class Workers:
    """A prefill and a decode worker: `capacity` requests each (more are refused, as a worker refuses),
    a prompt in `prefill_s`, `tokens` output tokens `token_s` apart; the decode worker also refuses
    everything while `full_until` (another router's requests filling it)."""

    def __init__(
        self, bus: Bus, *, prefill_capacity: int, decode_capacity: int, prefill_s: float, tokens: int, token_s: float
    ):
        self.bus, self.prefill_s, self.tokens, self.token_s = bus, prefill_s, tokens, token_s
        self.capacity = {"prefill": prefill_capacity, "decode": decode_capacity}
        self.running = {"prefill": 0, "decode": 0}
        self.full_until = 0.0
        self.refused = {"prefill": 0, "decode": 0}
        self._beating: asyncio.Task | None = None

    async def start(self) -> None:
        await self.bus.serve(Subjects.worker("prefill", "pre"), self._prefill)
        await self.bus.serve(Subjects.worker("decode", "dec"), self._decode)
        self._beating = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
        await self.bus.close()

    def _take(self, role: str) -> None:
        if self.running[role] >= self.capacity[role] or (role == "decode" and time.monotonic() < self.full_until):
            self.refused[role] += 1
            raise AtCapacity(f"{role} worker is at capacity ({self.capacity[role]} requests)")
        self.running[role] += 1

    async def _prefill(self, req, blob):
        self._take("prefill")
        try:
            await asyncio.sleep(self.prefill_s)
        finally:
            self.running["prefill"] -= 1
        return PrefillResult(
            prompt_token_ids=[1, 2],
            max_tokens=self.tokens,
            fingerprint=FINGERPRINT,
            first=TokenDelta(text="t", token_ids=[100], prompt_tokens=2, completion_tokens=1),
        )

    async def _decode(self, req, blob):
        self._take("decode")
        try:
            for i in range(len(req.output_token_ids), self.tokens):
                await asyncio.sleep(self.token_s)
                yield TokenDelta(
                    text="t",
                    token_ids=[100 + i],
                    prompt_tokens=2,
                    completion_tokens=i + 1,
                    finish_reason="length" if i == self.tokens - 1 else None,
                )
        finally:
            self.running["decode"] -= 1

    async def _beat(self) -> None:
        while True:
            for role, worker_id in (("prefill", "pre"), ("decode", "dec")):
                await self.bus.publish(
                    Subjects.HEARTBEAT,
                    WorkerInfo(
                        worker_id=worker_id,
                        role=role,
                        model="m",
                        fingerprint=FINGERPRINT,
                        max_model_len=4096,
                        running=self.running[role],
                        queued_tokens=0,
                        capacity=self.capacity[role],
                        heartbeat_s=HEARTBEAT_S,
                    ),
                )
            await asyncio.sleep(HEARTBEAT_S)


@asynccontextmanager
async def fake_workers(nats_url: str, **settings):
    """`Workers` on an event loop of their own, in a thread: the test's clients, hundreds of connections
    on this loop, cannot hold their heartbeats back past the router's expiry (it would drop them)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-workers", daemon=True)
    thread.start()

    async def on_their_loop(coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def started() -> Workers:
        workers = Workers(await Bus.connect(nats_url, "fake-workers"), **settings)
        await workers.start()
        return workers

    try:
        workers = await on_their_loop(started())
        try:
            yield workers
        finally:
            await on_their_loop(workers.stop())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        loop.close()


@pytest.fixture
def nats(tmp_path):
    """A nats-server of this test's own: (its process, URL, port)."""
    port = free_port()
    child, url = start_nats(tmp_path, port)
    try:
        yield child, url, port
    finally:
        child.stop()


@asynccontextmanager
async def router(tmp_path: Path, nats_url: str, **settings: str):
    """`python -m llmesh_router` on a free port, its log in `tmp_path/router.log`."""
    port = free_port()
    env = (
        {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
        | {
            "MESH_NATS_URL": nats_url,
            "MESH_PORT": str(port),
            "MESH_LENGTH_SAMPLE_FRACTION": "0",
            "MESH_LOCAL_PREFILL_MARGIN_S": "",  # always disaggregate: these workers run no whole requests
            "MESH_REQUEST_TIMEOUT_S": "30",
        }
        | {f"MESH_{k.upper()}": v for k, v in settings.items()}
    )
    child = Child("router", [sys.executable, "-m", "llmesh_router"], env=env, log_path=tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_healthy, url, 30, [child])
        yield url, child
    finally:
        child.stop(10)


async def _streamed(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[int, dict, list]:
    """(status, headers, events) of one streamed completion; events: the parsed `data:` lines."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 64, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        events = []
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
        return resp.status_code, dict(resp.headers), events


def _problems(log: str) -> list[str]:
    return [
        line
        for line in log.splitlines()
        if any(s in line for s in ("Traceback", "never retrieved", "already running", "Exception in ASGI"))
    ]


async def test_a_burst_past_capacity_gets_200s_that_finish_or_429s_before_any_byte(tmp_path, nats):
    """Streamed requests in a burst far past what the workers hold: each is either a 200 whose stream
    ends with its last token and [DONE] (never an error event after the first token: a request past its
    prompt is not refused for waiting), or a 429 with a Retry-After no longer than the queue's longest
    wait, before any byte of a stream."""
    _, nats_url, _ = nats
    async with fake_workers(
        nats_url,
        prefill_capacity=2,
        decode_capacity=4,
        prefill_s=0.05,
        tokens=8,
        token_s=0.05,
    ):
        async with router(tmp_path, nats_url, queue_max_wait_s="2", queue_max_waiting="64") as (url, child):
            limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                results = await asyncio.gather(*(_streamed(client, url, f"p{i}") for i in range(240)))
        log = child.log_tail(400)
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, f"{statuses}\n{log}"
    assert statuses.count(200) >= 8 and statuses.count(429) >= 8, statuses  # the burst did overload it
    for status, headers, events in results:
        if status == 200:
            assert not any(isinstance(e, dict) and "error" in e for e in events), events
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events
            assert sum(1 for e in events if isinstance(e, dict)) == 8
        else:
            assert 1 <= int(headers["retry-after"]) <= 2, headers
    assert not _problems(log), log


async def test_a_decode_worker_full_when_prompts_finish_makes_requests_wait_not_fail(tmp_path, nats):
    """The decode worker refuses every decode for 3 s (its heartbeats show room: another router's
    requests fill it) while prompts keep finishing and others wait for a prefill: each request past its
    prompt waits for a decode slot within its deadline and completes; none gets a 503."""
    _, nats_url, _ = nats
    async with fake_workers(
        nats_url,
        prefill_capacity=1,
        decode_capacity=16,
        prefill_s=0.1,
        tokens=4,
        token_s=0.02,
    ) as workers:
        async with router(tmp_path, nats_url, queue_max_wait_s="1.5") as (url, child):
            workers.full_until = time.monotonic() + 3.0
            async with httpx.AsyncClient(timeout=60) as client:

                async def complete(i: int) -> httpx.Response:
                    await asyncio.sleep(0.05 * i)
                    return await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": f"p{i}"})

                resps = await asyncio.gather(*(complete(i) for i in range(30)))
        log = child.log_tail(400)
    statuses = [r.status_code for r in resps]
    assert workers.refused["decode"] >= 3, workers.refused
    assert set(statuses) <= {200, 429}, [r.text for r in resps if r.status_code not in (200, 429)]
    assert statuses.count(200) >= 5, statuses
    assert all(r.json()["choices"][0]["text"] == "tttt" for r in resps if r.status_code == 200)
    assert not _problems(log), log


async def test_a_client_leaving_while_nats_restarts_leaves_no_error_behind(tmp_path, nats):
    """Clients wait for their first token while nats-server dies and comes back; they leave during the
    reconnection. The router logs no error for it (no generator closed while running, no task whose
    failure nobody read) and serves the next request."""
    server, nats_url, _ = nats
    async with fake_workers(
        nats_url,
        prefill_capacity=8,
        decode_capacity=8,
        prefill_s=1.0,
        tokens=2,
        token_s=0.01,
    ):
        async with router(tmp_path, nats_url) as (url, child):
            async with httpx.AsyncClient(timeout=30) as client:
                leaving = [asyncio.create_task(_streamed(client, url, f"p{i}")) for i in range(6)]
                await asyncio.sleep(0.3)
                server.kill()
                await asyncio.sleep(0.4)
                for task in leaving:
                    task.cancel()  # the client closes its connections mid-reconnection
                await asyncio.gather(*leaving, return_exceptions=True)
                await asyncio.sleep(0.5)
                server.restart()
                await asyncio.sleep(2.0)  # reconnected; the abandoned requests wound down
                status, _, events = await _streamed(client, url, "after")
            assert status == 200 and events[-1] == "[DONE]", events
            log = child.log_tail(400)
    assert not _problems(log), log
