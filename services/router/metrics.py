"""Prometheus metrics of the router (one registry per app, so tests can build several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmesh_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"],
                                registry=r)
        self.errors = Counter("llmesh_request_errors", "Failed requests by error code", ["code"], registry=r)
        self.inflight = Gauge("llmesh_requests_inflight", "Requests being served", registry=r)
        self.latency = Histogram("llmesh_request_seconds", "End-to-end latency", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("llmesh_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.prefill_seconds = Histogram("llmesh_prefill_seconds", "Prefill round trip", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.tokens = Counter("llmesh_generated_tokens", "Completion tokens streamed", registry=r)
        self.length_predictions = Counter(
            "llmesh_request_length_predictions", "Requests by length-prediction outcome (ok, timeout, unavailable, "
            "error; skipped: no prompt text; unsampled: not predicted (MESH_LENGTH_SAMPLE_FRACTION); late: "
            "answered after the prefill, dropped)", ["outcome"], registry=r)
        self.prefill_sites = Counter("llmesh_prefill_sites", "Requests by where their prompt was computed: "
                                     "prefill (disaggregated) or decode (the whole request on a decode worker, "
                                     "the prefill queue being longer)", ["site"], registry=r)
        self.dispatch = Counter("llmesh_dispatch_decisions", "Worker choices by dispatch policy, role and whether "
                                "the request waited in the router's queue first (placed, queued)",
                                ["policy", "role", "outcome"], registry=r)
        self.queue_seconds = Histogram("llmesh_queue_wait_seconds", "Time a request waited in the router's queue "
                                       "for a worker with room", buckets=LATENCY_BUCKETS, registry=r)
        self.resumes = Counter("llmesh_decode_resumes", "Decodes continued on another worker: migrated (a live "
                               "migration's hand-over), failover (the worker died or refused; resumed from the "
                               "KV in the store)", ["kind"], registry=r)
        self.redispatches = Counter("llmesh_redispatches", "Requests placed again because the worker first chosen "
                                    "was gone before it got them (NATS had no responder)", registry=r)
        self.workers = Gauge("llmesh_live_workers", "Live workers by role", ["role"], registry=r)
