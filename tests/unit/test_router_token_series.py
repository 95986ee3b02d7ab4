"""The router's per-token series read as prometheus_client's own would for the same tokens."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmesh_router.metrics import INTER_TOKEN_LATENCY_BUCKETS, TokenSeries


def _samples(registry: CollectorRegistry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_token_series_expose_what_prometheus_clients_series_would():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    series = TokenSeries(ours)
    gaps = Histogram(
        "vllm:inter_token_latency_seconds", "", ["model_name"], buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=theirs
    )
    generated = Counter("vllm:generation_tokens", "", ["model_name"], registry=theirs)
    # gaps on a bound, between bounds, below the first and past the last; several tokens in one delta
    for model, gap, tokens in [("a", 0.01, 1), ("a", 0.012, 3), ("b", 0.001, 2), ("a", 100.0, 1), ("b", 0.3, 4)]:
        series.of(model).gap(gap, tokens)
        series.of(model).generated += tokens
        for _ in range(tokens):
            gaps.labels(model).observe(gap)
        generated.labels(model).inc(tokens)
    got, want = _samples(ours), _samples(theirs)
    assert got.keys() == want.keys() and len(got) == 2 * (len(INTER_TOKEN_LATENCY_BUCKETS) + 4)
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-9, key
