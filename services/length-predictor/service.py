"""The length-predictor service on NATS.

- `mesh.length.predict` (queue group, so replicas share the load): LengthPredictRequest ->
  LengthPrediction. Requests that arrive while a batch runs form the next batch.
- `mesh.length.remaining` (queue group): LengthRemainingRequest -> LengthRemaining, a running
  request's tokens still to come, from its prompt and its output so far (decode workers ask).
- `mesh.length.observed.<replica>`: workers' LengthObserved reports. Each is scored against its
  prediction (running accuracy and error per predicted bucket), and with the prompt this replica
  kept it becomes a refit sample of the served model that answered.
- `mesh.length.stats.<replica>`: LengthStats.
- `mesh.length.refit` (queue group): LengthRefit -> LengthRefitResult, the shared head or one
  model's. An accepted head goes out on `mesh.length.head` to every replica and into Redis for
  replicas that start later.

Heads per served model: a model's requests are predicted by its own head once a refit of it was
accepted, by the shared head until then. Every `length_refit_every` samples of a model (counted
across replicas in Redis, so one replica refits), that model's head is refitted in the background
through the same gated refit as the operator's.

Bad input: an empty prompt is an `invalid_request` error. A prompt longer than
MAX_PROMPT_CHARS characters is cut (the model reads its start and its full length) and the
prediction says `truncated`; generated text is cut to its last MAX_GENERATED_CHARS. An
undecodable message (text that is not UTF-8, wrong fields) is answered with a `bad_message`
error by the bus.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar, cast

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmesh.wire.bus import Bus
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.lengths import MAX_GENERATED_CHARS, NUM_BUCKETS, bucket_label, bucket_of, cut_prompt
from llmesh.wire.messages import (
    LengthBucketStats,
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
    Subjects,
)

from . import data
from .predictor import Head, Predictor, refit_split
from .settings import LengthPredictorSettings

log = logging.getLogger(__name__)
Item = TypeVar("Item")
Result = TypeVar("Result")

QUEUE = "length-predictor"
SAMPLES_KEY = "llmesh:length:samples"  # a list of [prompt, tokens]; a model's: SAMPLES_KEY:<model>
MODELS_KEY = "llmesh:length:models"  # the set of models with samples
OBSERVED_KEY = "llmesh:length:observed:{model}"  # samples of a model ever added: the refit trigger
HEAD_KEY = "llmesh:length:head:{base}"  # the shared head
MODEL_HEADS_KEY = "llmesh:length:heads:{base}"  # a hash: model -> its own head
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
REFIT_CHUNK = 256  # prompts per model-thread job while a refit scores them
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class Batcher(Generic[Item, Result]):
    """Runs `fn` in `executor` on batches of the items submitted while the previous batch ran."""

    def __init__(self, fn: Callable[[list[Item]], list[Result]], max_batch: int, executor: ThreadPoolExecutor):
        self._fn, self._max, self._executor = fn, max_batch, executor
        self._queue: asyncio.Queue[tuple[Item, asyncio.Future[Result]]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def submit(self, item: Item) -> Result:
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, future))
        return await future

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [(item, future) for item, future in batch if not future.done()]  # callers that gave up
            if not batch:
                continue
            results: Sequence[Result | Exception]
            try:
                results = await loop.run_in_executor(self._executor, self._fn, [item for item, _ in batch])
            except Exception as exc:
                log.exception("a batch of %d failed", len(batch))
                results = [exc] * len(batch)
            for (_, future), result in zip(batch, results):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)


@dataclass
class _BucketScore:
    observed: int = 0
    exact: int = 0
    within_one: int = 0
    abs_error_tokens: float = 0.0


class Calibration:
    """Predictions against actual lengths, per predicted bucket. Requests cut by max_tokens are
    counted apart: their natural length is unknown."""

    def __init__(self) -> None:
        self.scores = [_BucketScore() for _ in range(NUM_BUCKETS)]
        self.censored = 0

    def record(self, predicted: LengthPrediction, actual_tokens: int, finish_reason: str) -> bool:
        """Score one finished request; False if it was cut short (not scored)."""
        if finish_reason != "stop":
            self.censored += 1
            return False
        truth, score = bucket_of(actual_tokens), self.scores[predicted.bucket]
        score.observed += 1
        score.exact += truth == predicted.bucket
        score.within_one += abs(truth - predicted.bucket) <= 1
        score.abs_error_tokens += abs(predicted.expected_tokens - actual_tokens)
        return True

    def buckets(self) -> list[LengthBucketStats]:
        return [
            LengthBucketStats(
                bucket=b,
                label=bucket_label(b),
                observed=s.observed,
                exact=s.exact,
                within_one=s.within_one,
                abs_error_tokens=s.abs_error_tokens,
            )
            for b, s in enumerate(self.scores)
        ]


class _CalibrationCollector:
    def __init__(self, calibration: Calibration):
        self.calibration = calibration

    def collect(self) -> Iterator[Metric]:
        families = {
            "observed": CounterMetricFamily(
                "llmesh_length_observed", "Finished requests scored, by predicted bucket", labels=["bucket"]
            ),
            "exact": CounterMetricFamily(
                "llmesh_length_exact",
                "Scored requests whose actual length fell in the predicted bucket",
                labels=["bucket"],
            ),
            "within_one": CounterMetricFamily(
                "llmesh_length_within_one",
                "Scored requests whose actual length fell in the predicted bucket or a neighbour",
                labels=["bucket"],
            ),
            "abs_error_tokens": CounterMetricFamily(
                "llmesh_length_abs_error_tokens", "Sum of |expected - actual| tokens", labels=["bucket"]
            ),
        }
        accuracy = GaugeMetricFamily("llmesh_length_accuracy", "Running exact-bucket accuracy", labels=["bucket"])
        mae = GaugeMetricFamily("llmesh_length_mae_tokens", "Running mean absolute error", labels=["bucket"])
        for stats in self.calibration.buckets():
            for field, family in families.items():
                family.add_metric([stats.label], float(getattr(stats, field)))
            if stats.observed:
                accuracy.add_metric([stats.label], stats.exact / stats.observed)
                mae.add_metric([stats.label], stats.abs_error_tokens / stats.observed)
        yield from families.values()
        yield accuracy
        yield mae
        yield CounterMetricFamily(
            "llmesh_length_censored",
            "Reports of requests cut by max_tokens (not scored)",
            value=self.calibration.censored,
        )


class SharedState:
    """Recent (prompt, actual length) samples of each served model and the accepted heads: in Redis,
    shared by the replicas and kept across restarts, when a URL is given; else in this process. A
    Redis outage keeps samples locally."""

    def __init__(self, redis_url: str, limit: int):
        self.limit = limit  # samples kept per model
        self._local: dict[str, deque[tuple[str, int]]] = defaultdict(lambda: deque(maxlen=limit))
        self._local_added: defaultdict[str, int] = defaultdict(int)
        self._redis = (
            aioredis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1) if redis_url else None
        )

    @staticmethod
    def _samples_key(model: str) -> str:
        return f"{SAMPLES_KEY}:{model}" if model else SAMPLES_KEY

    async def add_sample(self, model: str, prompt: str, tokens: int) -> int:
        """Keep a sample of `model`; returns how many of its samples were added so far."""
        if self._redis is not None:
            try:
                key = self._samples_key(model)
                pipe = self._redis.pipeline()  # (its commands return it, but are typed as the client's)
                pipe.lpush(key, json.dumps([prompt, tokens]))
                pipe.ltrim(key, 0, self.limit - 1)
                pipe.sadd(MODELS_KEY, model)
                pipe.incr(OBSERVED_KEY.format(model=model))
                return int((await pipe.execute())[-1])
            except REDIS_ERRORS as exc:
                log.warning("Redis is unreachable (%s): keeping the sample in memory", exc)
        self._local[model].append((prompt, tokens))
        self._local_added[model] += 1
        return self._local_added[model]

    async def samples(self, model: str | None = None) -> list[data.Example]:
        """`model`'s samples; None: every model's."""
        models = set(self._local) if model is None else {model}
        if self._redis is not None:
            try:
                if model is None:
                    models |= {cast(bytes, m).decode() for m in await self._redis.smembers(MODELS_KEY)} | {""}
                pairs = [
                    (m, json.loads(item))
                    for m in sorted(models)
                    for item in await self._redis.lrange(self._samples_key(m), 0, self.limit - 1)
                ]
            except REDIS_ERRORS as exc:
                log.warning("Redis is unreachable (%s): refitting on this replica's samples only", exc)
                pairs = []
        else:
            pairs = []
        pairs += [(m, pair) for m in sorted(models) for pair in self._local.get(m, ())]
        return [data.Example(prompt, tokens, "deployment", m or data.UNKNOWN) for m, (prompt, tokens) in pairs]

    async def save_head(self, base_version: str, model: str, blob: bytes) -> None:
        if self._redis is not None:
            try:
                if model:
                    await self._redis.hset(MODEL_HEADS_KEY.format(base=base_version), model, blob)
                else:
                    await self._redis.set(HEAD_KEY.format(base=base_version), blob)
            except REDIS_ERRORS as exc:
                log.warning("Redis is unreachable (%s): replicas that start later will not load the refit", exc)

    async def load_heads(self, base_version: str) -> dict[str, bytes]:
        """The saved heads, by model ("": the shared head)."""
        if self._redis is None:
            return {}
        try:
            shared = await self._redis.get(HEAD_KEY.format(base=base_version))  # bytes: no decode_responses
            own = await self._redis.hgetall(MODEL_HEADS_KEY.format(base=base_version))
        except REDIS_ERRORS as exc:
            log.warning("Redis is unreachable (%s): serving the artifact's head", exc)
            return {}
        heads = {cast(bytes, model).decode(): cast(bytes, blob) for model, blob in own.items()}
        return heads | ({"": cast(bytes, shared)} if shared is not None else {})

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


class LengthPredictorService:
    """Build with `await LengthPredictorService.create(...)`: the model is loaded in the one thread
    that runs it (see llmesh_lengthpred.predictor)."""

    def __init__(
        self,
        bus: Bus,
        predictor: Predictor,
        settings: LengthPredictorSettings,
        shared: SharedState,
        model_thread: ThreadPoolExecutor,
    ):
        self.bus, self.predictor, self.settings, self.shared = bus, predictor, settings, shared
        self.model_thread = model_thread
        self.replica = predictor.replica
        self.calibration = Calibration()
        self.batcher: Batcher[tuple[str, int, str], LengthPrediction] = Batcher(
            self._predict_batch, settings.length_max_batch, model_thread
        )
        self.remaining_batcher: Batcher[tuple[str, str, int, int, str], LengthRemaining] = Batcher(
            self._remaining_batch, settings.length_max_batch, model_thread
        )
        # request id -> (model, prompt), until its report
        self._prompts: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._refit_lock = asyncio.Lock()
        self._auto_refits: dict[str, asyncio.Task] = {}  # model -> its background refit, while it runs
        self.answered = 0
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "llmesh_length_predict_seconds",
            "From a request's arrival to its answer (its _count: the predictions answered)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "llmesh_length_batch_size",
            "Prompts per model call",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.refits = Counter(
            "llmesh_length_refits", "Refits by outcome and served model", ["outcome", "model"], registry=self.registry
        )
        self.registry.register(_CalibrationCollector(self.calibration))

    @classmethod
    async def create(cls, bus: Bus, settings: LengthPredictorSettings, replica: str) -> LengthPredictorService:
        model_thread = ThreadPoolExecutor(1, thread_name_prefix="length-model")
        try:
            predictor = await asyncio.get_running_loop().run_in_executor(
                model_thread, partial(Predictor, settings.length_artifact_dir, replica, settings.length_generator)
            )
        except BaseException:
            model_thread.shutdown(wait=False)
            raise
        return cls(
            bus, predictor, settings, SharedState(settings.redis_url, settings.length_recent_samples), model_thread
        )

    async def _in_model_thread(self, fn: Callable[..., Result], *args: Any) -> Result:
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, partial(fn, *args))

    async def start(self) -> None:
        for model, saved in (await self.shared.load_heads(self.predictor.base_version)).items():
            try:
                self._install(model, Head.from_bytes(saved), "Redis")
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring the saved head of %r: unreadable (%s)", model, exc)
        await self.bus.serve(Subjects.LENGTH_PREDICT, self.predict, queue=QUEUE, span="length-predictor predict")
        await self.bus.serve(Subjects.LENGTH_REMAINING, self.remaining, queue=QUEUE, traced=False)
        await self.bus.serve(Subjects.length_observed(self.replica), self.observe, traced=False)
        await self.bus.serve(Subjects.length_stats(self.replica), self.stats, traced=False)
        await self.bus.serve(Subjects.LENGTH_REFIT, self.refit, queue=QUEUE, span="length-predictor refit")
        await self.bus.serve(Subjects.LENGTH_HEAD, self.on_head, traced=False)
        log.info(
            "%s ready: model %s (generator %s), batches of up to %d",
            self.replica,
            self.predictor.version,
            self.predictor.generator,
            self.settings.length_max_batch,
        )

    async def close(self) -> None:
        for task in list(self._auto_refits.values()):
            task.cancel()
        await self.batcher.close()
        await self.remaining_batcher.close()
        await self.shared.close()
        self.model_thread.shutdown(wait=False, cancel_futures=True)

    def _predict_batch(self, items: list[tuple[str, int, str]]) -> list[LengthPrediction]:
        self.batch_size.observe(len(items))
        return self.predictor.predict(*map(list, zip(*items)))

    def _remaining_batch(self, items: list[tuple[str, str, int, int, str]]) -> list[LengthRemaining]:
        return self.predictor.predict_remaining(*map(list, zip(*items)))

    async def remaining(self, req: LengthRemainingRequest, blob: memoryview) -> LengthRemaining:
        if not isinstance(req, LengthRemainingRequest):
            raise InvalidRequest(f"expected LengthRemainingRequest, got {type(req).__name__}")
        prompt, _ = cut_prompt(req.prompt)
        chars = max(req.generated_chars or 0, len(req.generated))
        return await self.remaining_batcher.submit(
            (prompt, req.generated[-MAX_GENERATED_CHARS:], chars, req.generated_tokens, req.model)
        )

    async def predict(self, req: LengthPredictRequest, blob: memoryview) -> LengthPrediction:
        if not isinstance(req, LengthPredictRequest):
            raise InvalidRequest(f"expected LengthPredictRequest, got {type(req).__name__}")
        if not req.prompt.strip():
            raise InvalidRequest("the prompt is empty", param="prompt")
        started = time.monotonic()
        text, chars = cut_prompt(req.prompt)
        prediction = await self.batcher.submit((text, max(chars, req.prompt_chars or 0), req.model))
        self.latency.observe(time.monotonic() - started)
        self.answered += 1
        if req.request_id:
            self._prompts[req.request_id] = (req.model, text)
            while len(self._prompts) > self.settings.length_pending_predictions:
                self._prompts.popitem(last=False)
        trace.get_current_span().set_attributes(
            {
                "length.bucket": prediction.label,
                "length.expected_tokens": prediction.expected_tokens,
                "length.truncated": prediction.truncated,
            }
        )
        return prediction

    async def observe(self, report: LengthObserved, blob: memoryview) -> None:
        predicted_for, prompt = self._prompts.pop(report.request_id, ("", ""))
        if not self.calibration.record(report.predicted, report.actual_tokens, report.finish_reason) or not prompt:
            return
        model = report.model or predicted_for
        added = await self.shared.add_sample(model, prompt, report.actual_tokens)
        every = self.settings.length_refit_every
        if model and every and added % every == 0 and model not in self._auto_refits:
            task = asyncio.create_task(self._auto_refit(model))
            self._auto_refits[model] = task
            task.add_done_callback(lambda _: self._auto_refits.pop(model, None))

    async def _auto_refit(self, model: str) -> None:
        """`model`'s head refitted in the background, as the operator's refit would (its result is logged)."""
        try:
            await self._refit(
                LengthRefit(
                    model=model,
                    min_samples=self.settings.length_refit_min_samples,
                    holdout_fraction=self.settings.length_refit_holdout,
                )
            )
        except Exception:  # a failed refit keeps the current head; the next trigger tries again
            log.exception("automatic refit of %r failed", model)

    async def stats(self, req: LengthStatsRequest, blob: memoryview) -> LengthStats:
        return LengthStats(
            replica=self.replica,
            model_version=self.predictor.version,
            predictions=self.answered,
            censored=self.calibration.censored,
            samples=len(await self.shared.samples()),
            buckets=self.calibration.buckets(),
            heads={model: head.version for model, head in self.predictor.model_heads.items()},
        )

    async def refit(self, req: LengthRefit, blob: memoryview) -> LengthRefitResult:
        if not isinstance(req, LengthRefit):
            raise InvalidRequest(f"expected LengthRefit, got {type(req).__name__}")
        return await self._refit(req)

    async def _refit(self, req: LengthRefit) -> LengthRefitResult:
        """Refit `req.model`'s head (""): the shared one, on every model's samples) and keep it only if its
        held-out log loss is lower than the head serving that model now."""
        model, name = req.model, head_name(req.model)
        async with self._refit_lock:
            samples = await self.shared.samples(model or None)
            current = self.predictor.version_for(model)
            result = dict(samples=len(samples), held_out=0, before={}, after={}, model_version=current, model=model)
            if len(samples) < req.min_samples:
                self.refits.labels("skipped", model).inc()
                reason = f"{len(samples)} samples; the refit asks for at least {req.min_samples}"
                log.info("refit of %s skipped: %s", name, reason)
                return LengthRefitResult(accepted=False, reason=reason, **result)
            try:
                fit, held = refit_split(samples, req.holdout_fraction)
            except ValueError as exc:
                self.refits.labels("skipped", model).inc()
                log.info("refit of %s skipped: %s", name, exc)
                return LengthRefitResult(accepted=False, reason=str(exc), **result)
            fit_scores = await self._scores([s.prompt for s in fit])
            held_scores = await self._scores([s.prompt for s in held])
            head, before, after = await self._in_model_thread(
                Predictor.refit_head,
                self.predictor.head_for(model),
                fit_scores,
                [s.output_tokens for s in fit],
                held_scores,
                [s.output_tokens for s in held],
            )
            result.update(held_out=len(held), before=before, after=after)
            change = (
                f"held-out log loss {before['log_loss']:.3f} -> {after['log_loss']:.3f}, "
                f"MAE {before['mae_tokens']:.0f} -> {after['mae_tokens']:.0f} tokens "
                f"(constant {after['constant_mae_tokens']:.0f}) on {len(held)} of {len(samples)} samples"
            )
            if head is None:
                self.refits.labels("rejected", model).inc()
                log.info("refit of %s rejected (%s): keeping %s", name, change, current)
                return LengthRefitResult(accepted=False, reason=f"{change}: not better, kept {current}", **result)
            self._install(model, head, "refit")
            blob_out = head.to_bytes()
            await self.shared.save_head(self.predictor.base_version, model, blob_out)
            await self.bus.publish(
                Subjects.LENGTH_HEAD,
                LengthHead(base_version=self.predictor.base_version, version=head.version, model=model),
                blob_out,
            )
            self.refits.labels("accepted", model).inc()
            now = self.predictor.version_for(model)
            log.info("refit of %s accepted (%s): now serving %s", name, change, now)
            return LengthRefitResult(
                accepted=True, reason=f"{change}: now serving {now}", **(result | {"model_version": now})
            )

    async def _scores(self, prompts: list[str]) -> np.ndarray:
        """The model's scores of many prompts, a chunk at a time, so that predictions go on in between."""
        parts = [
            await self._in_model_thread(self.predictor.scores, prompts[i : i + REFIT_CHUNK])
            for i in range(0, len(prompts), REFIT_CHUNK)
        ]
        return np.concatenate(parts)

    async def on_head(self, msg: LengthHead, blob: memoryview) -> None:
        if not isinstance(msg, LengthHead) or msg.version == self.predictor.head_for(msg.model).version:
            return
        if msg.base_version != self.predictor.base_version:
            log.warning(
                "ignoring head %s: fitted on artifact %s, this replica runs %s",
                msg.version,
                msg.base_version,
                self.predictor.base_version,
            )
            return
        try:
            head = Head.from_bytes(bytes(blob))
        except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            log.warning("ignoring head %s: unreadable (%s)", msg.version, exc)
            return
        if head.version != msg.version:
            log.warning("ignoring head announced as %s: its content is %s", msg.version, head.version)
            return
        self._install(msg.model, head, "another replica's refit")

    def _install(self, model: str, head: Head, source: str) -> None:
        """Serve `head` for `model`'s requests ("": the shared head, for models without one of their own)."""
        previous = self.predictor.head_for(model).version
        if model:
            self.predictor.model_heads[model] = head
        else:
            self.predictor.head = head
        log.info("serving head %s for %s from %s (was %s)", head.version, head_name(model), source, previous)


def head_name(model: str) -> str:
    return repr(model) if model else "the shared head"
