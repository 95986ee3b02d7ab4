"""The router in-process (httpx ASGI transport) on a real nats-server, with heartbeats but no engines."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from llmesh.policies import RequestView
from llmesh.wire.bus import Bus
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import WorkerLost
from llmesh.wire.messages import WorkerInfo
from llmesh_router.auth import KeyRing
from llmesh_router.dispatch import Dispatcher
from llmesh_router.lengths import LengthTagger
from llmesh_router.metrics import RouterMetrics
from llmesh_router.registry import WorkerRegistry
from llmesh_router.scheduler import Scheduler
from llmesh_router.service import create_app

pytestmark = pytest.mark.timeout(30)


def info(worker_id, role="prefill", fingerprint="f" * 32, model="m", capacity=4):
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        model=model,
        fingerprint=fingerprint,
        max_model_len=2048,
        running=0,
        queued_tokens=0,
        capacity=capacity,
        heartbeat_s=1.0,
    )


async def _client(nats_url, scheduler, keys=None):
    bus = await Bus.connect(nats_url, "router-test")
    metrics = RouterMetrics()
    app = create_app(
        Dispatcher(bus, scheduler, LengthTagger(bus, metrics, timeout_s=0.1), metrics),
        scheduler.registry,
        metrics,
        request_timeout_s=5,
        keys=keys,
    )
    return bus, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


async def test_a_model_no_worker_serves_waits_for_one_and_an_unknown_model_is_404_at_once(nats_url):
    registry = WorkerRegistry(catalogue=[ServedModel(name="m"), ServedModel(name="n")])
    bus, client = await _client(nats_url, Scheduler(registry, model_wait_s=0.5))
    try:
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["m", "n"]
        for path, body in [
            ("/v1/completions", {"model": "m", "prompt": "hi"}),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        ]:
            started = time.monotonic()
            resp = await client.post(path, json=body)
            assert 0.5 <= time.monotonic() - started < 1.5
            assert resp.status_code == 503 and "no worker served 'm' within 0.5s" in resp.json()["error"]["message"]
        started = time.monotonic()
        resp = await client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        assert time.monotonic() - started < 0.5
        health = await client.get("/health")
        assert health.status_code == 503
        assert "llmesh_request_errors_total" in (await client.get("/metrics")).text

        # workers of `n` join while a request for it waits: it goes to them (ghosts: NATS finds no one there,
        # so it waits again, for a worker that answers)
        waiting = asyncio.create_task(client.post("/v1/completions", json={"model": "n", "prompt": "hi"}))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        registry.on_heartbeat(info("p-n", model="n"))
        registry.on_heartbeat(info("d-n", role="decode", model="n"))
        resp = await waiting
        assert resp.status_code == 503 and "no worker served 'n'" in resp.json()["error"]["message"], resp.text
        assert "llmesh_redispatches_total 1.0" in (await client.get("/metrics")).text
    finally:
        await client.aclose()
        await bus.close()


async def test_a_models_targets_in_the_catalogue_are_its_requests_defaults(nats_url):
    registry = WorkerRegistry(catalogue=[ServedModel(name="m", ttft_slo_ms=250, tpot_slo_ms=20)])
    scheduler = Scheduler(registry, model_wait_s=0)
    seen: list[RequestView] = []
    admit = scheduler.admit

    async def spy(role, view, *args, **kwargs):
        seen.append(view)
        return await admit(role, view, *args, **kwargs)

    scheduler.admit = spy  # type: ignore[method-assign]
    bus, client = await _client(nats_url, scheduler)
    try:
        for extra in ({}, {"ttft_slo_ms": 900}):
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"} | extra)
            assert resp.status_code == 503  # no worker: only the request's view matters here
        assert [(v.ttft_slo_s, v.tpot_slo_s) for v in seen] == [(0.25, 0.02), (0.9, 0.02)]
    finally:
        await client.aclose()
        await bus.close()


async def test_with_api_keys_every_openai_endpoint_needs_one_and_a_refused_request_reaches_no_worker(nats_url):
    registry = WorkerRegistry()
    registry.on_heartbeat(info("p1"))  # a worker that never answers: a request past the door would wait on it
    scheduler = Scheduler(registry)
    bus, client = await _client(nats_url, scheduler, keys=KeyRing.load("sk-good alice 1", None))
    completion = {"model": "m", "prompt": "hi", "max_tokens": 2}
    try:
        for headers, code in [
            ({}, "missing_api_key"),
            ({"Authorization": "Bearer sk-bad"}, "invalid_api_key"),
            ({"Authorization": "sk-good"}, "missing_api_key"),
        ]:
            for method, path, body in [
                ("GET", "/v1/models", None),
                ("POST", "/v1/completions", completion),
                ("POST", "/v1/chat/completions", {"model": "m", "messages": []}),
                ("POST", "/v1/responses", {"model": "m", "input": "hi"}),
                ("GET", "/v1/responses/resp_1", None),
                ("DELETE", "/v1/responses/resp_1", None),
            ]:
                resp = await client.request(method, path, json=body, headers=headers)
                assert resp.status_code == 401 and resp.json()["error"]["code"] == code, (path, headers, resp.text)
                assert resp.json()["error"]["type"] == "invalid_request_error"
        assert registry.live("prefill")[0].worker_id == "p1" and not scheduler.view(registry.live()[0]).assigned
        good = {"Authorization": "Bearer sk-good"}
        assert (await client.get("/v1/models", headers=good)).json()["data"][0]["id"] == "m"
        limited = await client.get("/v1/models", headers=good)  # 1 request per minute
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(limited.headers["Retry-After"]) == 60
        assert (await client.get("/health")).status_code == 503  # probes and scrapers need no key
        assert 'llmesh_request_errors_total{code="invalid_api_key"} 6.0' in (await client.get("/metrics")).text
    finally:
        await client.aclose()
        await bus.close()


async def test_worker_that_vanished_without_deregistering_is_503_fast(nats_url):
    """Heartbeats say a worker lives, but nothing serves its subject: NATS answers no-responders, and with
    no other worker for the model and no wait for one configured, the request ends at once."""
    registry = WorkerRegistry()
    registry.on_heartbeat(info("ghost-prefill"))
    registry.on_heartbeat(info("ghost-decode", role="decode"))
    bus, client = await _client(nats_url, Scheduler(registry, model_wait_s=0))
    try:
        started = time.monotonic()
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert time.monotonic() - started < 1
        assert resp.status_code == 503, resp.text
        assert (await client.post("/v1/completions", json={"model": "other", "prompt": "hi"})).status_code == 404
    finally:
        await client.aclose()
        await bus.close()


def test_registry_expires_silent_workers_and_tells_watchers():
    now = [0.0]
    registry = WorkerRegistry(missed_heartbeats=3, clock=lambda: now[0])
    registry.on_heartbeat(info("p1"))
    lost = []
    with registry.watch("p1", lost.append):
        now[0] = 2.9
        registry.expire()
        assert not lost
        now[0] = 3.1
        registry.expire()
    assert len(lost) == 1 and isinstance(lost[0], WorkerLost)
    assert registry.live() == []


def test_a_late_check_or_a_streaming_worker_is_not_taken_for_a_dead_one():
    """The router itself starved of CPU for 5 s (the heartbeats meanwhile unread), and a worker
    whose heartbeats are late while it streams tokens: neither is dropped."""
    now = [0.0]
    registry = WorkerRegistry(missed_heartbeats=3, clock=lambda: now[0])
    registry.on_heartbeat(info("p1"))
    registry.on_heartbeat(info("d1", role="decode"))
    now[0] = 5.0
    registry.expire(late_s=4.8)  # due at 0.2
    assert {w.worker_id for w in registry.live()} == {"p1", "d1"}
    now[0] = 7.5
    registry.heard_from("d1")
    now[0] = 10.0
    registry.expire()
    assert [w.worker_id for w in registry.live()] == ["d1"]  # p1: silent 5.2 s of the router's time


def test_decode_is_paired_only_with_a_matching_fingerprint():
    registry = WorkerRegistry()
    registry.on_heartbeat(info("d1", role="decode", fingerprint="a" * 32))
    registry.on_heartbeat(info("d2", role="decode", fingerprint="b" * 32))
    request = RequestView("r1", "m", prompt_tokens=8, arrival=0.0, deadline=60.0)
    scheduler = Scheduler(registry)
    assert scheduler.pick("decode", request, fingerprint="b" * 32).worker_id == "d2"
    with pytest.raises(Exception, match="KV fingerprint"):
        scheduler.pick("decode", request, fingerprint="c" * 32)


async def test_prefill_worker_that_dies_mid_request_fails_it_at_once(nats_url):
    """The worker takes the request and then goes silent: the router answers 502 when its
    heartbeats lapse, long before the request's deadline."""
    now = [0.0]
    registry = WorkerRegistry(missed_heartbeats=3, clock=lambda: now[0])
    registry.on_heartbeat(info("stuck-prefill"))
    registry.on_heartbeat(info("stuck-decode", role="decode"))
    bus, client = await _client(nats_url, Scheduler(registry))
    worker_bus = await Bus.connect(nats_url, "stuck-worker")
    got_request = asyncio.Event()

    async def never_answers(msg, blob):
        got_request.set()
        await asyncio.sleep(3600)

    await worker_bus.serve("mesh.prefill.stuck-prefill", never_answers)
    try:
        call = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "hi"}))
        await asyncio.wait_for(got_request.wait(), 5)
        now[0] = 10.0  # its heartbeats stop
        started = time.monotonic()
        registry.expire()
        resp = await asyncio.wait_for(call, 5)
        assert time.monotonic() - started < 1
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "worker_lost"
    finally:
        await client.aclose()
        await worker_bus.close()
        await bus.close()


async def test_a_backed_up_prefill_queue_sends_the_whole_request_to_a_decode_worker(nats_url):
    """Prefill computes 100 tokens/s here, so a 100-token prompt queued behind another would wait
    2 s; the decode worker (which also runs whole requests) answers in 1 s: it gets the request."""
    from llmesh.wire.messages import PrefillRequest, PrefillResult, Subjects, TokenDelta

    registry = WorkerRegistry()
    # A stale heartbeat still counts an earlier prompt: the first request must not go whole to decode for it.
    registry.on_heartbeat(
        info("slow-prefill").model_copy(update={"prefill_tokens_per_s": 100.0, "queued_tokens": 10_000})
    )
    registry.on_heartbeat(info("spare-decode", role="decode").model_copy(update={"generates": True}))
    bus, client = await _client(nats_url, Scheduler(registry))
    workers = await Bus.connect(nats_url, "fake-workers")
    served: list[str] = []

    async def prefill(req, blob):
        served.append(f"prefill {req.request_id}")
        await asyncio.sleep(1.0)
        return PrefillResult(
            prompt_token_ids=req.prompt_token_ids,
            max_tokens=3,
            fingerprint="f" * 32,
            first=TokenDelta(text="a", token_ids=[7], prompt_tokens=100, completion_tokens=1),
        )

    async def decode(req, blob):
        served.append(f"decode {req.request_id}")
        for i in (2, 3):
            yield TokenDelta(
                text="b",
                token_ids=[8],
                finish_reason="length" if i == 3 else None,
                prompt_tokens=100,
                completion_tokens=i,
            )

    async def generate(req: PrefillRequest, blob):
        served.append(f"generate {req.request_id}")
        assert isinstance(req, PrefillRequest) and req.prompt_token_ids == list(range(1, 101))
        for i in (1, 2, 3):
            await asyncio.sleep(1.0 if i == 1 else 0.05)  # its prompt takes as long as on the prefill worker
            yield TokenDelta(
                text="c",
                token_ids=[9],
                finish_reason="length" if i == 3 else None,
                prompt_tokens=100,
                completion_tokens=i,
            )

    await workers.serve(Subjects.worker("prefill", "slow-prefill"), prefill)
    await workers.serve(Subjects.worker("decode", "spare-decode"), decode)
    await workers.serve(Subjects.generate("spare-decode"), generate)
    try:

        async def complete():
            resp = await client.post(
                "/v1/completions", json={"model": "m", "prompt": list(range(1, 101)), "max_tokens": 3}
            )
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

        first = asyncio.create_task(complete())
        await asyncio.sleep(0.2)  # the first prompt is on the prefill worker: 1 s to go, then this one's 1 s
        second = asyncio.create_task(complete())
        await asyncio.sleep(0.2)  # the decode worker is busy with the second: the prefill worker is as soon
        third = asyncio.create_task(complete())
        texts = await asyncio.gather(first, second, third)
        assert texts == ["abb", "ccc", "abb"]
        assert [s.split()[0] for s in served].count("generate") == 1
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


async def _one_slot_workers(nats_url, prefill_s):
    """A prefill worker that takes one request at a time, `prefill_s` each, and a decode worker."""
    from llmesh.wire.messages import PrefillResult, TokenDelta

    workers = await Bus.connect(nats_url, "fake-workers")
    order: list[str] = []

    async def prefill(req, blob):
        order.append(req.prompt)
        await asyncio.sleep(prefill_s)
        return PrefillResult(
            prompt_token_ids=[1, 2],
            max_tokens=2,
            fingerprint="f" * 32,
            first=TokenDelta(text="a", token_ids=[7], prompt_tokens=2, completion_tokens=1),
        )

    async def decode(req, blob):
        yield TokenDelta(text="b", token_ids=[8], finish_reason="length", prompt_tokens=2, completion_tokens=2)

    await workers.serve("mesh.prefill.one-slot", prefill)
    await workers.serve("mesh.decode.dec", decode)
    registry = WorkerRegistry()
    registry.on_heartbeat(info("one-slot", capacity=1))
    registry.on_heartbeat(info("dec", role="decode"))
    return workers, registry, order


async def test_a_request_sent_to_a_worker_gone_since_its_heartbeat_is_placed_again(nats_url):
    """Ghosts heart-beat (not yet known dead) with more room than the live workers, so the policy
    picks them first; NATS has no responder on their subjects: the router sends each ghost nothing
    more until it beats again and places the request on a live worker, which answers it."""
    workers, registry, order = await _one_slot_workers(nats_url, prefill_s=0.0)
    registry.on_heartbeat(info("one-slot", capacity=2))
    scheduler = Scheduler(registry)
    for worker_id in ("one-slot", "dec"):
        scheduler.reserve(worker_id)  # a request on its way: the (idle) ghosts are less loaded
    registry.on_heartbeat(info("ghost-prefill"))
    registry.on_heartbeat(info("ghost-decode", role="decode"))
    bus, client = await _client(nats_url, scheduler)
    try:
        for prompt in ("p0", "p1"):
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": prompt})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == "ab"
        assert order == ["p0", "p1"]
        metrics = (await client.get("/metrics")).text
        # the prefill ghost once (the second request went straight to the live worker); the decode
        # ghost's request had its first token, so it failed over instead
        assert "llmesh_redispatches_total 1.0" in metrics
        assert 'llmesh_decode_resumes_total{kind="failover"} 1.0' in metrics
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


async def test_requests_wait_in_the_router_queue_for_a_full_worker_and_run_in_order(nats_url):
    workers, registry, order = await _one_slot_workers(nats_url, prefill_s=0.3)
    bus, client = await _client(nats_url, Scheduler(registry, max_waiting=8, max_wait_s=5))
    try:
        started = time.monotonic()
        calls = []
        for i in range(3):
            calls.append(asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})))
            await asyncio.sleep(0.02)
        resps = await asyncio.gather(*calls)
        assert [r.status_code for r in resps] == [200, 200, 200], [r.text for r in resps]
        assert order == ["p0", "p1", "p2"]  # one at a time, in arrival order
        assert time.monotonic() - started >= 0.9
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


@pytest.mark.parametrize(
    "max_waiting, max_wait_s, expected",
    [
        (1, 5.0, [200, 200, 429]),  # the queue holds one: the third is refused at once
        (8, 0.2, [200, 429, 429]),  # nobody gets a slot within 0.2 s
    ],
)
async def test_a_full_queue_or_a_long_wait_is_429_with_retry_after(nats_url, max_waiting, max_wait_s, expected):
    workers, registry, _ = await _one_slot_workers(nats_url, prefill_s=0.5)
    bus, client = await _client(nats_url, Scheduler(registry, max_waiting=max_waiting, max_wait_s=max_wait_s))
    try:
        calls = []
        for i in range(3):
            calls.append(asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})))
            await asyncio.sleep(0.02)
        resps = await asyncio.gather(*calls)
        assert [r.status_code for r in resps] == expected
        for r in resps:
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.json()["error"]["type"] == "requests"
                assert int(r.headers["Retry-After"]) >= 1
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


async def _slow_decode_workers(nats_url, decode_s, decode_capacity=1):
    """A prefill worker with room to spare and a decode worker with `decode_capacity` slots whose
    decodes take `decode_s`; returns what each was sent, with when, in order."""
    from llmesh.wire.messages import PrefillResult, TokenDelta

    workers = await Bus.connect(nats_url, "fake-workers")
    sent: list[tuple[str, float]] = []

    async def prefill(req, blob):
        sent.append(("prefill", time.monotonic()))
        return PrefillResult(
            prompt_token_ids=[1, 2],
            max_tokens=2,
            fingerprint="f" * 32,
            first=TokenDelta(text="a", token_ids=[7], prompt_tokens=2, completion_tokens=1),
        )

    async def decode(req, blob):
        sent.append(("decode", time.monotonic()))
        await asyncio.sleep(decode_s)
        yield TokenDelta(text="b", token_ids=[8], finish_reason="length", prompt_tokens=2, completion_tokens=2)

    await workers.serve("mesh.prefill.pre", prefill)
    await workers.serve("mesh.decode.dec", decode)
    registry = WorkerRegistry()
    registry.on_heartbeat(info("pre", capacity=8))
    registry.on_heartbeat(info("dec", role="decode", capacity=decode_capacity))
    return workers, registry, sent


@pytest.mark.parametrize("max_wait_s, expected", [(5.0, [200, 200]), (0.2, [200, 429])])
async def test_a_prompt_is_admitted_only_with_decode_room_for_it(nats_url, max_wait_s, expected):
    """The decode worker has one slot: the second request waits before its prompt, not after its first
    token, and one that cannot wait long enough is a 429 at the door that reached no worker."""
    workers, registry, sent = await _slow_decode_workers(nats_url, decode_s=0.5)
    bus, client = await _client(nats_url, Scheduler(registry, max_waiting=8, max_wait_s=max_wait_s))
    try:
        calls = []
        for i in range(2):
            calls.append(asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})))
            await asyncio.sleep(0.05)
        resps = await asyncio.gather(*calls)
        assert [r.status_code for r in resps] == expected, [r.text for r in resps]
        kinds = [kind for kind, _ in sent]
        if expected[1] == 200:
            assert kinds == ["prefill", "decode", "prefill", "decode"]
            assert sent[2][1] - sent[1][1] >= 0.5  # p1's prompt only once p0's decode had ended
        else:
            assert kinds == ["prefill", "decode"]
            assert resps[1].json()["error"]["code"] == "rate_limit_exceeded" and "Retry-After" in resps[1].headers
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


async def test_a_worker_fuller_than_the_router_knew_refuses_and_the_request_waits_for_room(nats_url):
    """The decode worker's last heartbeat shows room, but it is full (another router's requests): it
    refuses the decode. The router counts it full until it beats again, and the request, its first
    token already streamed, goes on there then instead of failing."""
    from llmesh.wire.errors import AtCapacity
    from llmesh.wire.messages import PrefillResult, TokenDelta

    workers = await Bus.connect(nats_url, "fake-workers")
    decodes: list[float] = []

    async def prefill(req, blob):
        return PrefillResult(
            prompt_token_ids=[1, 2],
            max_tokens=2,
            fingerprint="f" * 32,
            first=TokenDelta(text="a", token_ids=[7], prompt_tokens=2, completion_tokens=1),
        )

    async def decode(req, blob):
        decodes.append(time.monotonic())
        if len(decodes) == 1:
            raise AtCapacity("dec is at capacity (4 requests)")
        yield TokenDelta(text="b", token_ids=[8], finish_reason="length", prompt_tokens=2, completion_tokens=2)

    await workers.serve("mesh.prefill.pre", prefill)
    await workers.serve("mesh.decode.dec", decode)
    registry = WorkerRegistry()
    registry.on_heartbeat(info("pre"))
    registry.on_heartbeat(info("dec", role="decode"))
    bus, client = await _client(nats_url, Scheduler(registry))
    try:

        async def beat_later():
            while not decodes:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            registry.on_heartbeat(info("dec", role="decode").model_copy(update={"running": 3}))

        beating = asyncio.create_task(beat_later())
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        await beating
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "ab"
        assert len(decodes) == 2 and decodes[1] - decodes[0] >= 0.3  # it waited for the heartbeat, not retried at once
        assert 'llmesh_decode_resumes_total{kind="refused"} 1.0' in (await client.get("/metrics")).text
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


def test_a_refusal_counts_the_worker_full_until_a_request_ends_or_it_beats():
    registry = WorkerRegistry()
    registry.on_heartbeat(info("d", role="decode", capacity=4))
    scheduler = Scheduler(registry)
    request = RequestView("r1", "m", prompt_tokens=8, arrival=0.0, deadline=60.0)
    assert scheduler.decode_room("m") == 4 and scheduler.decode_room("other") is None
    assert scheduler.pick("decode", request).worker_id == "d"
    scheduler.refused_at_capacity("d")
    scheduler.release("d")  # the refused request's own reservation
    assert scheduler.decode_room("m") == 0
    scheduler.release("d")  # a request that ran there ended
    assert scheduler.decode_room("m") == 1
    registry.on_heartbeat(info("d", role="decode", capacity=4).model_copy(update={"running": 2}))
    assert scheduler.decode_room("m") == 2


async def test_priority_and_slo_targets_reach_the_policy_and_the_workers(nats_url):
    """vLLM's `priority` and the mesh's SLO fields, from the OpenAI request to what the dispatch
    policy reads and what the workers hold (and report on heartbeats)."""
    from llmesh.policies import Policy
    from llmesh.wire.messages import PrefillResult, TokenDelta

    seen_by_policy, seen_by_workers = [], []

    def spy(ctx, worker):
        seen_by_policy.append((ctx.role, ctx.request.priority, ctx.request.ttft_slo_s, ctx.request.tpot_slo_s))
        return 0.0

    registry = WorkerRegistry()
    scheduler = Scheduler(registry, Policy("spy", costs=((1.0, spy),)))
    registry.on_heartbeat(info("p"))
    registry.on_heartbeat(info("d", role="decode"))
    workers = await Bus.connect(nats_url, "fake-workers")

    async def prefill(req, blob):
        seen_by_workers.append(("prefill", req.priority))
        return PrefillResult(
            prompt_token_ids=[1, 2],
            max_tokens=2,
            fingerprint="f" * 32,
            first=TokenDelta(text="a", token_ids=[7], prompt_tokens=2, completion_tokens=1),
        )

    async def decode(req, blob):
        seen_by_workers.append(("decode", req.priority))
        yield TokenDelta(text="b", token_ids=[8], finish_reason="length", prompt_tokens=2, completion_tokens=2)

    await workers.serve("mesh.prefill.p", prefill)
    await workers.serve("mesh.decode.d", decode)
    bus, client = await _client(nats_url, scheduler)
    try:
        resp = await client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "hi", "max_tokens": 2, "priority": -1, "ttft_slo_ms": 500, "tpot_slo_ms": 40},
        )
        assert resp.status_code == 200, resp.text
        # after the first token only the overall deadline binds: no TTFT target for the decode pick
        assert ("prefill", -1, 0.5, 0.04) in seen_by_policy and ("decode", -1, None, 0.04) in seen_by_policy
        assert seen_by_workers == [("prefill", -1), ("decode", -1)]
        bad = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "ttft_slo_ms": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttft_slo_ms"
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


async def test_cache_aware_sends_a_shared_prefix_back_where_it_went(nats_url):
    """MESH_POLICY=cache_aware over three prefill workers: prompts that share a long prefix follow
    the first one's worker although it is the busiest (load within the balance thresholds); an
    unrelated prompt goes by load."""
    from llmesh.policies import make_policy
    from llmesh.wire.messages import PrefillResult, TokenDelta

    registry = WorkerRegistry()
    scheduler = Scheduler(registry, make_policy("cache_aware"))
    for name in ("p1", "p2", "p3"):
        registry.on_heartbeat(info(name))
    registry.on_heartbeat(info("d", role="decode"))
    workers = await Bus.connect(nats_url, "fake-workers")
    served = []

    def prefill_on(name):
        async def prefill(req, blob):
            served.append((name, req.prompt[:6]))
            return PrefillResult(
                prompt_token_ids=[1],
                max_tokens=1,
                fingerprint="f" * 32,
                first=TokenDelta(text="a", token_ids=[7], finish_reason="length", prompt_tokens=1, completion_tokens=1),
            )

        return prefill

    for name in ("p1", "p2", "p3"):
        await workers.serve(f"mesh.prefill.{name}", prefill_on(name))
    bus, client = await _client(nats_url, scheduler)
    shared = "You are a helpful assistant. " * 40  # ~1200 characters: 4 whole blocks
    try:
        for i, prompt in enumerate([shared + "first question", shared + "second", "unrelated " * 60, shared + "third"]):
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
            assert resp.status_code == 200, resp.text
            if i == 0:  # the first one's worker now reports two requests running
                registry.on_heartbeat(info(served[0][0]).model_copy(update={"running": 2}))
        first = served[0][0]
        assert [name for name, head in served if head == "You ar"] == [first] * 3
        assert served[2][0] != first  # no prefix in common: by load
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


# ---- resuming a decode elsewhere: live migration's hand-over, failover --------------------------------------


async def _resumable_workers(nats_url, first_decode):
    """A prefill worker (prompt [1, 2], first token 7, budget 6), the decode worker `first_decode`
    (serving its first decode) and `dec-b` (recording every DecodeRequest it gets, then finishing)."""
    from llmesh.wire.messages import DecodeRequest, KvHandle, PrefillResult, TokenDelta

    workers = await Bus.connect(nats_url, "fake-workers")
    seen: list[tuple[str, DecodeRequest]] = []
    handle = KvHandle(fingerprint="f" * 32, block_size=16, block_hashes=["h0"], num_tokens=2)

    async def prefill(req, blob):
        return PrefillResult(
            prompt_token_ids=[1, 2],
            max_tokens=6,
            fingerprint="f" * 32,
            kv=handle,
            first=TokenDelta(text="a", token_ids=[7], prompt_tokens=2, completion_tokens=1),
        )

    async def dec_b(req, blob):
        seen.append(("dec-b", req))
        done = len(req.output_token_ids)
        for i in range(done, 6):
            yield TokenDelta(
                text=str(i),
                token_ids=[10 + i],
                finish_reason="length" if i == 5 else None,
                prompt_tokens=2,
                completion_tokens=i + 1,
            )

    async def first(req, blob):
        seen.append(("dec-a", req))
        async for item in first_decode(req):
            yield item

    await workers.serve("mesh.prefill.pre", prefill)
    await workers.serve("mesh.decode.dec-a", first)
    await workers.serve("mesh.decode.dec-b", dec_b)
    registry = WorkerRegistry(missed_heartbeats=1)
    registry.on_heartbeat(info("pre"))
    registry.on_heartbeat(info("dec-a", role="decode").model_copy(update={"heartbeat_s": 0.2}))
    registry.on_heartbeat(info("dec-b", role="decode").model_copy(update={"running": 1}))  # the busier one
    return workers, registry, seen, handle


async def test_a_migrated_decode_goes_on_at_its_target_with_every_token_so_far(nats_url):
    from llmesh.wire.messages import KvHandle, Migrated, TokenDelta

    moved = KvHandle(fingerprint="f" * 32, block_size=16, block_hashes=["h0"], num_tokens=3, tail_hash="t0")

    async def hands_over(req):
        yield TokenDelta(text="1", token_ids=[11], prompt_tokens=2, completion_tokens=2)
        yield TokenDelta(text="2", token_ids=[12], prompt_tokens=2, completion_tokens=3)
        yield Migrated(migration_id="m-1", target="dec-b", kv=moved, output_tokens=3)

    workers, registry, seen, _ = await _resumable_workers(nats_url, hands_over)
    bus, client = await _client(nats_url, Scheduler(registry))
    try:
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "a12345"
        assert resp.json()["choices"][0]["token_ids"] == [7, 11, 12, 13, 14, 15]
        (_, first), (_, resumed) = seen
        assert first.output_token_ids == [7] and first.migration_id is None
        assert resumed.output_token_ids == [7, 11, 12] and resumed.kv == moved and resumed.migration_id == "m-1"
        assert resumed.prompt_token_ids == [1, 2] and resumed.sampling.max_tokens == 6
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


async def test_a_decode_whose_worker_dies_resumes_elsewhere_without_losing_or_repeating_tokens(nats_url):
    from llmesh.wire.messages import TokenDelta

    async def dies(req):
        yield TokenDelta(text="1", token_ids=[11], prompt_tokens=2, completion_tokens=2)
        await asyncio.sleep(30)  # silent from here on, and no more heartbeats

    workers, registry, seen, handle = await _resumable_workers(nats_url, dies)
    expiry = asyncio.create_task(registry.run_expiry(0.05))
    bus, client = await _client(nats_url, Scheduler(registry))
    try:
        started = time.monotonic()
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == [7, 11, 12, 13, 14, 15]
        assert time.monotonic() - started < 2  # dropped after one missed 0.2 s heartbeat
        (_, first), (worker, resumed) = seen
        assert first.kv == handle and worker == "dec-b"
        assert resumed.output_token_ids == [7, 11] and resumed.kv is None  # the new worker looks the store up
    finally:
        expiry.cancel()
        await client.aclose()
        await workers.close()
        await bus.close()


async def test_a_migration_target_gone_before_the_hand_over_sends_the_request_back_to_its_source(nats_url):
    from llmesh.wire.messages import KvHandle, Migrated, TokenDelta

    moved = KvHandle(fingerprint="f" * 32, block_size=16, block_hashes=["h0"], num_tokens=2)
    calls = []

    async def hands_over_then_resumes(req):
        calls.append(req)
        if len(calls) == 1:
            yield TokenDelta(text="1", token_ids=[11], prompt_tokens=2, completion_tokens=2)
            yield Migrated(migration_id="m-2", target="dec-gone", kv=moved, output_tokens=2)
            return
        for i in range(2, 6):
            yield TokenDelta(
                text=str(i),
                token_ids=[10 + i],
                finish_reason="length" if i == 5 else None,
                prompt_tokens=2,
                completion_tokens=i + 1,
            )

    workers, registry, seen, _ = await _resumable_workers(nats_url, hands_over_then_resumes)
    registry.on_heartbeat(info("dec-gone", role="decode"))  # known, but nothing serves it any more
    bus, client = await _client(nats_url, Scheduler(registry))
    try:
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == [7, 11, 12, 13, 14, 15]
        assert [w for w, _ in seen] == ["dec-a", "dec-a"]
        assert calls[1].output_token_ids == [7, 11] and calls[1].kv == moved  # the hand-over's KV is still good
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()


async def test_a_nats_restart_mid_stream_resends_the_request_from_what_arrived_and_loses_nothing(tmp_path):
    """nats-server dies and comes back on its port while a decode streams: the worker's replies meanwhile
    are lost (NATS delivers at most once), so the router, once reconnected, sends the request again to
    the same worker with every token it got; the client's answer has each token once, without waiting
    for the deadline."""
    from llmesh.deploy.launcher import free_port, start_nats
    from llmesh.wire.messages import TokenDelta

    port = free_port()
    nats, url = start_nats(tmp_path, port)
    cut = asyncio.Event()

    async def slow(req):
        for i in range(len(req.output_token_ids), 6):
            if i == 3:
                cut.set()
            await asyncio.sleep(0.15)
            yield TokenDelta(
                text=str(i),
                token_ids=[10 + i],
                finish_reason="length" if i == 5 else None,
                prompt_tokens=2,
                completion_tokens=i + 1,
            )

    workers, registry, seen, _ = await _resumable_workers(url, slow)
    registry.on_heartbeat(info("dec-b", role="decode").model_copy(update={"running": 4, "capacity": 4}))  # full
    bus, client = await _client(url, Scheduler(registry))
    try:
        answer = asyncio.create_task(
            client.post("/v1/completions", json={"model": "m", "prompt": "x", "return_token_ids": True})
        )
        await asyncio.wait_for(cut.wait(), 10)
        nats.kill()
        started = time.monotonic()
        nats, _ = start_nats(tmp_path, port)
        resp = await asyncio.wait_for(answer, 20)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == [7, 11, 12, 13, 14, 15], [
            (w, r.output_token_ids) for w, r in seen
        ]
        assert time.monotonic() - started < 10
        assert [worker for worker, _ in seen] == ["dec-a", "dec-a"]
        resent = seen[1][1].output_token_ids
        assert 2 <= len(resent) <= 4 and resent == [7, 11, 12, 13][: len(resent)]  # what arrived before the cut
    finally:
        await client.aclose()
        await workers.close()
        await bus.close()
        nats.stop()
