"""The length-predictor service on a real nats-server and Redis, with the committed model: answers,
batching, bad input, online correction and refits; and the router attaching its predictions
(to workers that are test doubles here; tests/e2e/test_mesh.py runs it with real engines)."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgpack
import pytest
import redis
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmesh.wire.bus import Bus
from llmesh.wire.errors import BadMessage, InvalidRequest
from llmesh.wire.lengths import bucket_of
from llmesh.wire.messages import (
    Ack,
    DecodeRequest,
    LengthHead,
    LengthObserved,
    LengthPrediction,
    LengthPredictRequest,
    LengthRefit,
    LengthRefitResult,
    LengthRemaining,
    LengthRemainingRequest,
    LengthStats,
    LengthStatsRequest,
    PrefillRequest,
    PrefillResult,
    Subjects,
    TokenDelta,
    decode_any,
)
from llmesh_lengthpred import data
from llmesh_lengthpred.predictor import REFIT_SEED, Head
from llmesh_lengthpred.service import HEAD_KEY, LengthPredictorService
from llmesh_lengthpred.settings import LengthPredictorSettings
from llmesh_router.dispatch import Dispatcher
from llmesh_router.lengths import LengthTagger
from llmesh_router.metrics import RouterMetrics
from llmesh_router.registry import WorkerRegistry
from llmesh_router.scheduler import Scheduler
from llmesh_router.service import create_app

pytestmark = pytest.mark.timeout(180)

PROMPTS = [
    "Write a haiku about autumn.",
    "Explain how a transformer works, step by step, in detail.",
    "What is the capital of France?",
    "Write a long story about a dragon and a knight.",
]


@pytest.fixture(scope="module")
async def service(nats_url, redis_url):
    bus = await Bus.connect(nats_url, "length-predictor-test")
    settings = LengthPredictorSettings(
        _env_file=None, redis_url=redis_url, length_max_batch=32, length_recent_samples=1000
    )
    svc = await LengthPredictorService.create(bus, settings, "length-test")
    await svc.start()
    try:
        yield svc
    finally:
        await bus.close()
        await svc.close()


@pytest.fixture(scope="module")
async def client(nats_url):
    bus = await Bus.connect(nats_url, "length-client")
    try:
        yield bus
    finally:
        await bus.close()


async def predict(bus: Bus, prompt: str, request_id: str = "", model: str = "") -> LengthPrediction:
    reply, _ = await bus.request(
        Subjects.LENGTH_PREDICT,
        LengthPredictRequest(request_id=request_id, prompt=prompt, model=model),
        LengthPrediction,
        timeout=10,
    )
    return reply


async def stats(bus: Bus, replica: str) -> LengthStats:
    reply, _ = await bus.request(Subjects.length_stats(replica), LengthStatsRequest(), LengthStats, timeout=10)
    return reply


async def test_answers_over_nats_and_batches_concurrent_requests(service, client):
    one = await predict(client, PROMPTS[0])
    assert 0 <= one.bucket < 10 and 0 < one.confidence <= 1 and one.expected_tokens > 0
    assert one.replica == "length-test" and one.model_version == service.predictor.version and not one.truncated
    assert one == await predict(client, PROMPTS[0]), "the same prompt gets the same prediction"

    batches_before = service.batch_size._sum.get(), sum(b.get() for b in service.batch_size._buckets)
    prompts = [f"{PROMPTS[i % 4]} (variant {i})" for i in range(32)]
    started = time.monotonic()
    answers = await asyncio.gather(*(predict(client, p) for p in prompts))
    elapsed = time.monotonic() - started
    # Each answer is the one its own prompt gets alone: no rows mixed up.
    alone = await predict(client, prompts[5])
    assert answers[5] == alone and len({a.expected_tokens for a in answers}) > 4
    prompts_run = service.batch_size._sum.get() - batches_before[0]
    model_calls = sum(b.get() for b in service.batch_size._buckets) - batches_before[1]
    assert prompts_run == 32 + 1 and model_calls < 32 + 1, f"{model_calls} model calls for 33 prompts: no batching"
    print(f"32 concurrent predictions in {elapsed * 1000:.0f} ms, {model_calls - 1} model calls")


async def test_bad_input_gets_a_clear_error_and_the_service_keeps_serving(service, client):
    for empty in ("", "   \n\t"):
        with pytest.raises(InvalidRequest, match="empty"):
            await predict(client, empty)
    # Enormous: cut to MAX_PROMPT_CHARS, predicted from its start and the full length, flagged.
    huge = await predict(client, "Summarize this document. " + "lorem ipsum dolor sit amet " * 40_000)
    assert huge.truncated and 0 <= huge.bucket < 10
    assert not (await predict(client, "word " * 300)).truncated
    # Text that is not UTF-8, bytes that are no message, a message of the wrong type.
    header = msgpack.packb({"v": 1, "t": "LengthPredictRequest", "d": {"prompt": "x"}}, use_bin_type=True)
    not_utf8 = header.replace(b"\xa1x", b"\xa2\xff\xfe")
    for raw in (len(not_utf8).to_bytes(4, "big") + not_utf8, b"garbage", b""):
        reply = await client.nc.request(Subjects.LENGTH_PREDICT, raw, timeout=10)
        with pytest.raises(BadMessage):
            decode_any(reply.data)
    with pytest.raises(InvalidRequest, match="LengthPredictRequest"):
        await client.request(Subjects.LENGTH_PREDICT, Ack(), LengthPrediction, timeout=10)
    assert (await predict(client, PROMPTS[1])).bucket >= 0


async def remaining(bus: Bus, prompt: str, generated: str, tokens: int) -> LengthRemaining:
    reply, _ = await bus.request(
        Subjects.LENGTH_REMAINING,
        LengthRemainingRequest(prompt=prompt, generated=generated, generated_tokens=tokens),
        LengthRemaining,
        timeout=10,
    )
    return reply


async def test_remaining_length_answers_change_with_the_text_so_far(service, client):
    prompt = "Write a detailed guide to planting a vegetable garden, with a section for each season."
    opening = "Sure! Here is a detailed guide.\n\n## Spring\n\n1. Prepare the soil"
    ending = opening + " ... and that is all for winter.\n\nIn conclusion, I hope this helps. Happy gardening!"
    early, late = await remaining(client, prompt, opening, 16), await remaining(client, prompt, ending, 400)
    assert early.remaining_tokens > 0 and late.remaining_tokens > 0 and early.remaining_tokens != late.remaining_tokens
    assert early.replica == "length-test" and early.generated_tokens == 16 and early.informative
    # the serving model's tokens, not the predictor's: the same text counted as twice the tokens, twice the rest
    doubled = await remaining(client, prompt, opening, 32)
    assert doubled.remaining_tokens == pytest.approx(2 * early.remaining_tokens, rel=1e-6)
    # huge generated text is read by its end; bad input is refused, the service goes on
    assert (await remaining(client, prompt, "word " * 100_000, 100_000)).remaining_tokens > 0
    with pytest.raises(InvalidRequest, match="LengthRemainingRequest"):
        await client.request(Subjects.LENGTH_REMAINING, Ack(), LengthRemaining, timeout=10)
    raw = await client.nc.request(Subjects.LENGTH_REMAINING, b"garbage", timeout=10)
    with pytest.raises(BadMessage):
        decode_any(raw.data)


async def observe(service, client, prompt: str, actual: int, finish: str = "stop", model: str = "") -> LengthPrediction:
    request_id = f"req-{time.monotonic_ns()}"
    prediction = await predict(client, prompt, request_id, model)
    await client.publish(
        Subjects.length_observed(prediction.replica),
        LengthObserved(
            request_id=request_id, predicted=prediction, actual_tokens=actual, finish_reason=finish, model=model
        ),
    )
    return prediction


async def wait_for(condition, timeout: float = 10.0):
    give_up = time.monotonic() + timeout
    while not (result := await condition()):
        assert time.monotonic() < give_up, "condition not met in time"
        await asyncio.sleep(0.05)
    return result


async def test_reported_lengths_move_the_error_metrics(service, client, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    before = await stats(client, service.replica)
    prediction = await observe(service, client, PROMPTS[2], actual=3)
    b = prediction.bucket
    after = await wait_for(lambda: _changed(client, service.replica, before))
    row, old = after.buckets[b], before.buckets[b]
    assert row.observed == old.observed + 1
    assert row.exact == old.exact + (bucket_of(3) == b)
    assert row.within_one == old.within_one + (abs(bucket_of(3) - b) <= 1)
    assert row.abs_error_tokens == pytest.approx(old.abs_error_tokens + abs(prediction.expected_tokens - 3))
    assert after.samples == before.samples + 1
    # Cut by max_tokens: counted apart, not scored, not a sample.
    await observe(service, client, PROMPTS[2], actual=16, finish="length")
    censored = await wait_for(lambda: _changed(client, service.replica, after))
    assert censored.censored == after.censored + 1 and censored.buckets == after.buckets
    assert censored.samples == after.samples
    metrics = service.registry.get_sample_value("llmesh_length_observed_total", {"bucket": prediction.label})
    assert metrics == row.observed


async def _changed(client, replica, before: LengthStats) -> LengthStats | None:
    now = await stats(client, replica)
    return now if (now.buckets, now.censored) != (before.buckets, before.censored) else None


def _split(prompts: list[str], holdout: float) -> set[str]:
    _, held = data.split_by_prompt([data.Example(p, 1, "") for p in prompts], holdout, REFIT_SEED)
    return {e.prompt for e in held}


async def _feed(service, client, lengths: dict[str, int], model: str = "") -> None:
    before = (await stats(client, service.replica)).samples
    for prompt, actual in lengths.items():
        await observe(service, client, prompt, actual, model=model)
    await wait_for(lambda: _samples_at_least(client, service.replica, before + len(lengths)))


async def _samples_at_least(client, replica, n) -> bool:
    return (await stats(client, replica)).samples >= n


async def refit(client, **kw) -> LengthRefitResult:
    reply, _ = await client.request(Subjects.LENGTH_REFIT, LengthRefit(**kw), LengthRefitResult, timeout=120)
    return reply


async def test_refit_that_is_worse_is_rejected_and_a_better_one_serves_everywhere(service, client, redis_url):
    store = redis.Redis.from_url(redis_url)
    store.flushdb()
    original = service.predictor.head
    few = await refit(client, min_samples=20)
    assert not few.accepted and "0 samples" in few.reason
    prompts = [f"{PROMPTS[i % 4]} Question {i}." for i in range(40)]
    held = _split(prompts, 0.25)
    assert 4 <= len(held) <= 20
    current = {p: (await predict(client, p)).expected_tokens for p in prompts}
    # The fitting part says every answer is 3 tokens; the held-out part agrees with the current
    # model. A head fitted on the first is worse on the second: it must be rejected.
    await _feed(service, client, {p: round(current[p]) if p in held else 3 for p in prompts})
    version = service.predictor.version
    worse = await refit(client, min_samples=20, holdout_fraction=0.25)
    assert not worse.accepted, worse
    assert worse.after["log_loss"] > worse.before["log_loss"] and worse.held_out == sum(1 for p in prompts if p in held)
    assert service.predictor.version == version == worse.model_version
    assert (await predict(client, prompts[0])).model_version == version

    # Now the deployment's model really answers in 3 tokens, everywhere: the refit wins.
    store.flushdb()
    heads = await client.nc.subscribe(Subjects.LENGTH_HEAD)
    await _feed(service, client, {p: 3 for p in prompts})
    better = await refit(client, min_samples=20, holdout_fraction=0.25)
    assert better.accepted, better
    assert better.after["log_loss"] < better.before["log_loss"] and better.after["exact"] == 1.0
    assert better.model_version == service.predictor.version != version
    after = await predict(client, "Tell me about the ocean.")
    assert after.model_version == better.model_version and after.bucket == bucket_of(3)
    # Every replica hears of it, and replicas that start later find it in Redis.
    announced = await heads.next_msg(timeout=10)
    msg, blob = decode_any(announced.data)
    assert isinstance(msg, LengthHead) and better.model_version == f"{msg.base_version}-{msg.version}"
    assert service.predictor.base_version + "-" + Head.from_bytes(bytes(blob)).version == better.model_version
    saved = store.get(HEAD_KEY.format(base=service.predictor.base_version))
    assert service.predictor.base_version + "-" + Head.from_bytes(saved).version == better.model_version
    # a head that answers 3 for everything knows nothing a constant does not: it says so
    assert not after.informative and after.confidence == 0
    await heads.unsubscribe()
    service._install("", original, "test")  # the artifact's head again, for the tests that follow


async def test_a_models_head_is_refitted_by_itself_serves_only_that_model_and_outlives_a_restart(
    service, client, nats_url, redis_url
):
    redis.Redis.from_url(redis_url).flushdb()
    settings = service.settings
    service.settings = settings.model_copy(
        update={"length_refit_every": 40, "length_refit_min_samples": 20, "length_refit_holdout": 0.25}
    )
    try:
        prompts = [f"{PROMPTS[i % 4]} Item {i}." for i in range(40)]
        await _feed(service, client, {p: 3 for p in prompts[:39]}, model="terse")
        assert not service.predictor.model_heads and (await stats(client, service.replica)).heads == {}
        await _feed(service, client, {prompts[39]: 3}, model="terse")  # the 40th sample of the model, via Redis
        head = (await wait_for(lambda: _heads(client, service.replica)))["terse"]
        terse, other = (
            await predict(client, "Tell me about the ocean.", model="terse"),
            await predict(client, "Tell me about the ocean.", model="chatty"),
        )
        assert terse.bucket == bucket_of(3) and terse.model_version == f"{service.predictor.base_version}-{head}"
        assert other.model_version == service.predictor.version != terse.model_version
        # a replica started later serves it too, from Redis
        bus = await Bus.connect(nats_url, "length-predictor-later")
        later = await LengthPredictorService.create(bus, settings, "length-later")
        try:
            await later.start()
            assert later.predictor.model_heads == service.predictor.model_heads
        finally:
            await bus.close()
            await later.close()
    finally:
        service.settings = settings
        service.predictor.model_heads.clear()


async def _heads(client, replica) -> dict[str, str]:
    return (await stats(client, replica)).heads


# ---- the router ---------------------------------------------------------------------------------


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


def heartbeat(worker_id: str, role: str):
    from llmesh.wire.messages import WorkerInfo

    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        model="m",
        fingerprint="f" * 32,
        max_model_len=2048,
        running=0,
        queued_tokens=0,
        capacity=4,
        heartbeat_s=1.0,
    )


async def router_with_fake_workers(
    nats_url: str, name: str, length_timeout_s: float = 5.0, prefill_s: float = 0.0, **tagging
):
    """The router app in-process, and prefill/decode doubles on the bus that record what they get
    (the prefill takes `prefill_s`)."""
    bus = await Bus.connect(nats_url, f"router-{name}")
    seen: list[PrefillRequest | DecodeRequest] = []

    async def prefill(req, blob):
        seen.append(req)
        await asyncio.sleep(prefill_s)
        return PrefillResult(
            prompt_token_ids=[1, 2, 3],
            max_tokens=4,
            fingerprint="f" * 32,
            first=TokenDelta(text="a", token_ids=[7], prompt_tokens=3, completion_tokens=1),
        )

    async def decode(req, blob):
        seen.append(req)
        yield TokenDelta(text="b", token_ids=[8], finish_reason="stop", prompt_tokens=3, completion_tokens=2)

    await bus.serve(Subjects.worker("prefill", f"p-{name}"), prefill)
    await bus.serve(Subjects.worker("decode", f"d-{name}"), decode)
    registry = WorkerRegistry()
    registry.on_heartbeat(heartbeat(f"p-{name}", "prefill"))
    registry.on_heartbeat(heartbeat(f"d-{name}", "decode"))
    metrics = RouterMetrics()
    lengths = LengthTagger(bus, metrics, length_timeout_s, **tagging)
    app = create_app(Dispatcher(bus, Scheduler(registry), lengths, metrics), registry, metrics, request_timeout_s=30)
    return bus, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router"), metrics, seen


def outcomes(metrics: RouterMetrics) -> dict[str, float]:
    return {
        o: metrics.registry.get_sample_value("llmesh_request_length_predictions_total", {"outcome": o}) or 0
        for o in ("ok", "timeout", "unavailable", "error", "skipped", "unsampled", "late")
    }


def router_span(spans: InMemorySpanExporter) -> dict:
    found = [s for s in spans.get_finished_spans() if s.name == "router request"]
    assert found, "no router request span"
    return dict(found[-1].attributes)


async def test_a_policy_that_reads_predictions_gets_them_before_dispatch(service, client, nats_url, spans):
    bus, http, metrics, seen = await router_with_fake_workers(nats_url, "with-predictor", before_dispatch=True)
    try:
        resp = await http.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[3]}],
            },
        )
        assert resp.status_code == 200, resp.text
        expected = await predict(client, PROMPTS[3])  # the user's turns are what the predictor reads
        prefill, decode = seen
        assert prefill.predicted_length == decode.predicted_length == expected
        attrs = router_span(spans)
        assert attrs["length.prediction"] == "ok" and attrs["length.bucket"] == expected.label
        assert attrs["length.expected_tokens"] == pytest.approx(expected.expected_tokens)
        assert outcomes(metrics)["ok"] == 1
        # Token-id prompts have no text to read: dispatched without a prediction.
        seen.clear()
        resp = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
        assert resp.status_code == 200 and seen[0].predicted_length is None and outcomes(metrics)["skipped"] == 1
        # JSON can escape a lone surrogate, which no UTF-8 message can carry: a 400 before any dispatch.
        seen.clear()
        for path, body in [
            ("/v1/completions", b'{"model": "m", "prompt": "\\ud800 hi"}'),
            ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}'),
        ]:
            resp = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", resp.text
        assert not seen
    finally:
        await http.aclose()
        await bus.close()


async def settled_predictions(client, replica: str) -> int:
    """The replica's prediction count once it has stayed the same for half a second."""
    count = (await stats(client, replica)).predictions
    while True:
        await asyncio.sleep(0.5)
        now = (await stats(client, replica)).predictions
        if now == count:
            return count
        count = now


async def test_otherwise_a_sample_is_predicted_beside_the_prefill_never_delaying_it(service, client, nats_url, spans):
    # The prediction (tens of ms) is in before this prefill ends: decode carries it, prefill did not wait.
    bus, http, metrics, seen = await router_with_fake_workers(nats_url, "beside", prefill_s=1.0)
    try:
        resp = await http.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[2], "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        prefill, decode = seen
        assert prefill.predicted_length is None and decode.predicted_length == await predict(client, PROMPTS[2])
        assert outcomes(metrics)["ok"] == 1 and router_span(spans)["length.prediction"] == "ok"
    finally:
        await http.aclose()
        await bus.close()
    # A prefill that ends first does not wait: the prediction is late and dropped.
    in_time = await predict(client, PROMPTS[1])  # what the real replica says (asked before the slow one joins)
    bus, http, metrics, seen = await router_with_fake_workers(nats_url, "late")

    async def slow(req, blob):
        await asyncio.sleep(2)

    await bus.serve(Subjects.LENGTH_PREDICT, slow, queue="length-predictor")
    try:
        started = time.monotonic()
        for _ in range(3):  # the real replica or the slow one answers: never waited for
            resp = await http.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[1], "max_tokens": 4})
            assert resp.status_code == 200, resp.text
        assert time.monotonic() - started < 1.5
        # none from the slow one; the real replica's only where it beat the prefill (in CI, loaded, it once did)
        carried = [r.predicted_length for r in seen if r.predicted_length is not None]
        assert all(p == in_time for p in carried)
        assert outcomes(metrics)["late"] == 3 - len(carried) and outcomes(metrics).get("ok", 0) == len(carried)
    finally:
        await http.aclose()
        await bus.close()
    # None sampled: the predictor is not asked at all.
    bus, http, metrics, seen = await router_with_fake_workers(nats_url, "unsampled", sample_fraction=0.0)
    try:
        before = await settled_predictions(client, service.replica)  # the late ones above may still be computing
        resp = await http.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4})
        assert resp.status_code == 200 and outcomes(metrics)["unsampled"] == 1
        assert (await stats(client, service.replica)).predictions == before
    finally:
        await http.aclose()
        await bus.close()


async def test_router_serves_without_the_predictor_or_past_a_slow_one(tmp_path, spans):
    from llmesh.deploy.launcher import start_nats

    nats, url = start_nats(tmp_path)  # a mesh whose predictor is not running
    bus, http, metrics, seen = await router_with_fake_workers(url, "alone", length_timeout_s=0.05, before_dispatch=True)
    try:
        resp = await http.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert seen[0].predicted_length is None and outcomes(metrics)["unavailable"] == 1
        assert router_span(spans)["length.prediction"] == "unavailable"

        async def slow(req, blob):
            await asyncio.sleep(2)
            return None

        await bus.serve(Subjects.LENGTH_PREDICT, slow, queue="length-predictor")
        started = time.monotonic()
        resp = await http.post("/v1/completions", json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4})
        assert resp.status_code == 200 and time.monotonic() - started < 1
        assert outcomes(metrics)["timeout"] == 1 and router_span(spans)["length.prediction"] == "timeout"
    finally:
        await http.aclose()
        await bus.close()
        nats.stop()
