"""Prometheus metrics of the router (one registry per app, so tests can build several).

Request-level metrics carry vLLM's names, `model_name` label and histogram buckets (vLLM 0.32's
`vllm/v1/metrics/loggers.py` and `buckets.py`), so dashboards made for vLLM read the mesh as one
engine: the router is where a client's request arrives and its tokens leave. What only the mesh
has is named `llmesh_*`. Workers export their engines' own `vllm:*` metrics (KV usage,
preemptions, prefix cache) on `MESH_WORKER_METRICS_PORT`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from llmesh.wire.messages import TokenDelta

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# vLLM's bucket families (vllm.v1.metrics.buckets), copied so that the router need not import vLLM
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        model = ["model_name"]
        # vLLM's request-level metrics, for the mesh as a whole
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (from the request's arrival at the router).",
            model,
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.tokens = TokenSeries(r)  # vLLM's inter-token latency histogram and generation-token counter
        self.time_per_output_token = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            model,
            buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds (requests that produced a token).",
            model,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.http_wait = Histogram(
            "llmesh_router_http_wait_seconds",
            "From a request's first byte read to its handler: the router's event loop busy (relaying tokens, "
            "reading other requests) delays new requests this long.",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of the time a request waited in the router's queue for its first worker.",
            model,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "vllm:num_requests_running",
            "Requests in flight that are not waiting in the router's queue (on a worker, or between two).",
            model,
            registry=r,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting in the router's queue for a worker.", model, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", model, registry=r)
        self.request_success = Counter(
            "vllm:request_success",
            "Count of requests that produced a token, by how "
            "they finished (stop, length; abort: the client left; error).",
            [*model, "finished_reason"],
            registry=r,
        )
        # the mesh's own
        self.requests = Counter(
            "llmesh_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.errors = Counter("llmesh_request_errors", "Failed requests by error code", ["code"], registry=r)
        self.prefill_seconds = Histogram(
            "llmesh_prefill_seconds", "Prefill round trip", buckets=LATENCY_BUCKETS, registry=r
        )
        self.length_predictions = Counter(
            "llmesh_request_length_predictions",
            "Requests by length-prediction outcome (ok, timeout, unavailable, "
            "error; skipped: no prompt text; unsampled: not predicted (MESH_LENGTH_SAMPLE_FRACTION); late: "
            "answered after the prefill, dropped)",
            ["outcome"],
            registry=r,
        )
        self.prefill_sites = Counter(
            "llmesh_prefill_sites",
            "Requests by where their prompt was computed: "
            "prefill (disaggregated) or decode (the whole request on a decode worker, "
            "the prefill queue being longer)",
            ["site"],
            registry=r,
        )
        self.dispatch = Counter(
            "llmesh_dispatch_decisions",
            "Worker choices by dispatch policy, role and whether "
            "the request waited in the router's queue first (placed, queued)",
            ["policy", "role", "outcome"],
            registry=r,
        )
        self.adapter_dispatches = Counter(
            "llmesh_adapter_dispatches",
            "Workers chosen for requests that name a LoRA adapter, by role and whether the worker's engine held "
            "the adapter loaded then (yes; no: it loads it)",
            ["role", "loaded"],
            registry=r,
        )
        self.resumes = Counter(
            "llmesh_decode_resumes",
            "Decodes continued on another worker: migrated (a live "
            "migration's hand-over), failover (the worker died or failed; resumed from the "
            "KV in the store), refused (the worker was full: placed again when one has room)",
            ["kind"],
            registry=r,
        )
        self.redispatches = Counter(
            "llmesh_redispatches",
            "Requests placed again because the worker first chosen was gone before it got them (NATS had no responder)",
            registry=r,
        )
        self.workers = Gauge("llmesh_live_workers", "Live workers by role", ["role"], registry=r)
        self._in_flight: Tally[str] = Tally()  # model -> requests being served
        self._answered: dict[str, ModelSeries] = {}  # model -> its requests' series, once it has answered
        self._queued: Tally[str] = Tally()  # model -> of those, waiting in the router's queue

    def request(self, model: str, arrived: float) -> RequestTimes:
        """A request that arrived at `arrived` (monotonic), counted in flight until `RequestTimes.ended`."""
        self._in_flight[model] += 1
        return RequestTimes(self, model, arrived)

    def answered(self, model: str) -> ModelSeries:
        """`model`'s request series (they start with its first answer), looked up once: a labels() call costs as
        much as the observation it names, and a request makes seven."""
        series = self._answered.get(model)
        if series is None:
            series = self._answered[model] = ModelSeries(self, model)
        return series

    @contextmanager
    def queued(self, model: str) -> Iterator[None]:
        """A request of `model` waits in the router's queue while the block runs."""
        self._queued[model] += 1
        try:
            yield
        finally:
            _decrement(self._queued, model)

    def set_request_states(self, models: Iterable[str]) -> None:
        """vLLM's scheduler gauges, per model served (a request naming a model nobody serves is refused:
        its made-up name becomes no series)."""
        self.running.clear()
        self.waiting.clear()
        for model in models:
            self.waiting.labels(model).set(self._queued[model])
            self.running.labels(model).set(self._in_flight[model] - self._queued[model])


class ModelSeries:
    """One model's series of vLLM's request metrics (`RouterMetrics.answered`)."""

    def __init__(self, metrics: RouterMetrics, model: str):
        self.ttft, self.prompt_tokens = metrics.ttft.labels(model), metrics.prompt_tokens.labels(model)
        self.tokens = metrics.tokens.of(model)
        self.e2e, self.time_per_output_token = metrics.e2e.labels(model), metrics.time_per_output_token.labels(model)
        self._success, self._model = metrics.request_success, model
        self._succeeded: dict[str, Counter] = {}  # finished reason -> its series

    def success(self, finished_reason: str) -> Counter:
        counter = self._succeeded.get(finished_reason)
        if counter is None:
            counter = self._succeeded[finished_reason] = self._success.labels(self._model, finished_reason)
        return counter


class ModelTokens:
    """One model's per-token counts (`TokenSeries`)."""

    def __init__(self) -> None:
        self.created = time.time()
        self.generated = 0
        self.gap_counts = [0] * (len(INTER_TOKEN_LATENCY_BUCKETS) + 1)  # by bucket, the last +Inf; not cumulative
        self.gap_sum = 0.0

    def gap(self, seconds: float, tokens: int) -> None:
        """`tokens` tokens that came `seconds` apart each: an observation per token, as vLLM makes (a token a
        step)."""
        self.gap_counts[bisect_left(INTER_TOKEN_LATENCY_BUCKETS, seconds)] += tokens
        self.gap_sum += seconds * tokens


class TokenSeries:
    """vLLM's per-token series, `vllm:inter_token_latency_seconds` and `vllm:generation_tokens`, kept as plain
    counts by model that a delta adds to and a scrape reads: prometheus_client's own series take a lock for
    every value and walk the buckets for every observation, three locked increments a delta (~8% of a streamed
    token's router CPU, cProfile at 8dca963). One writer, the router's event loop, which also serves /metrics."""

    _GAPS = (
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds (as tokens reach the router).",
    )
    _GENERATED = ("vllm:generation_tokens", "Number of generation tokens processed.")
    _BOUNDS = (*map(floatToGoString, INTER_TOKEN_LATENCY_BUCKETS), "+Inf")  # as prometheus_client's `le` labels

    def __init__(self, registry: CollectorRegistry):
        self._models: dict[str, ModelTokens] = {}
        registry.register(self)

    def of(self, model: str) -> ModelTokens:
        tokens = self._models.get(model)
        if tokens is None:
            tokens = self._models[model] = ModelTokens()
        return tokens

    def describe(self) -> tuple[HistogramMetricFamily, CounterMetricFamily]:
        """The two families, empty (a scrape's `collect` fills them)."""
        gaps = HistogramMetricFamily(*self._GAPS, labels=["model_name"])
        return gaps, CounterMetricFamily(*self._GENERATED, labels=["model_name"])

    def collect(self) -> tuple[HistogramMetricFamily, CounterMetricFamily]:
        gaps, generated = self.describe()
        for model, tokens in self._models.items():
            gaps.add_metric([model], list(zip(self._BOUNDS, accumulate(tokens.gap_counts))), tokens.gap_sum)
            generated.add_metric([model], tokens.generated, created=tokens.created)
        return gaps, generated


class RequestTimes:
    """One request's vLLM-named observations: its first token, the gaps between the later ones, its end."""

    def __init__(self, metrics: RouterMetrics, model: str, arrived: float):
        self._metrics, self._model = metrics, model
        self._arrived = arrived
        self._first_at: float | None = None
        self._last_at = 0.0
        self._tokens = 0
        self._series: ModelSeries  # (from its first token)

    def seen(self, delta: TokenDelta) -> TokenDelta:
        """Record a delta as it reaches the router; returns it."""
        now, count = time.monotonic(), len(delta.token_ids)
        if self._first_at is None:
            self._first_at = now
            self._series = series = self._metrics.answered(self._model)
            series.ttft.observe(now - self._arrived)
            series.prompt_tokens.inc(delta.prompt_tokens)
        elif count:
            self._series.tokens.gap((now - self._last_at) / count, count)
        if count:
            self._last_at = now
            self._tokens += count
            self._series.tokens.generated += count
        return delta

    def ended(self, finished_reason: str) -> None:
        """The request is over; `finished_reason` counts only if a token had come."""
        _decrement(self._metrics._in_flight, self._model)
        if self._first_at is None:
            return
        series = self._series
        series.e2e.observe(time.monotonic() - self._arrived)
        series.success(finished_reason).inc()
        if self._tokens > 1:
            series.time_per_output_token.observe((self._last_at - self._first_at) / (self._tokens - 1))


def _decrement(tally: Tally[str], key: str) -> None:
    tally[key] -= 1
    if not tally[key]:
        del tally[key]  # made-up model names leave nothing behind
