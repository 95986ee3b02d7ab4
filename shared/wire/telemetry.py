"""OpenTelemetry setup and W3C trace-context propagation through NATS headers.

Spans go to an OTLP/HTTP endpoint when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (Jaeger in
docker compose), and/or as JSON lines under `MESH_TRACE_DIR` (one file per process),
which is how tests read traces back. With neither, no span is recorded: OpenTelemetry's
default tracer's spans cost next to nothing, and a request's trace context goes on as it came.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator

_configured = False


class _SystemRandomIds(IdGenerator):
    """Trace and span ids from the OS's randomness: OpenTelemetry's default draws from `random`, which
    vLLM seeds alike in every engine process, so a prefill and a decode engine made the same span
    ids (seen in a trace: the decode's KV load had the id of the prefill's last KV put)."""

    def generate_span_id(self) -> int:
        return secrets.randbits(64) or 1

    def generate_trace_id(self) -> int:
        return secrets.randbits(128) or 1


def setup_tracing(service_name: str, *, otlp_endpoint: str | None, trace_dir: str | None) -> None:
    """Install the global tracer provider once per process, where its spans have somewhere to go; a no-op after
    the first call. (A provider without one would build every span, its attributes and events, to drop them:
    measured, a fifth of a decode worker's CPU a 128-token request; docs/benchmarks/control-plane.md.)"""
    global _configured
    if _configured:
        return
    _configured = True
    if not (otlp_endpoint or trace_dir):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), id_generator=_SystemRandomIds())
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        out = open(os.path.join(trace_dir, f"{service_name}-{os.getpid()}.jsonl"), "a", buffering=1)
        exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(ctx: context.Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as headers: `traceparent`, `tracestate`."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(headers or {}))
