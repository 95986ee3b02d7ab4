"""A worker's /metrics (MESH_WORKER_METRICS_PORT) keeps vLLM's metric names whatever the scraper asks for."""

import urllib.request

from prometheus_client import REGISTRY, Gauge

from llmesh.engine.worker import serve_metrics

# what Prometheus 2.x sends: OpenMetrics first
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_engine_metrics_are_served_under_vllms_names_to_a_scraper_that_asks_for_openmetrics():
    usage = Gauge("vllm:test_kv_cache_usage_perc", "a vLLM-named gauge", ["model_name"], registry=REGISTRY)
    server = serve_metrics("127.0.0.1", 0)
    try:
        usage.labels("m").set(0.25)
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.server_address[1]}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            content_type, body = resp.headers["Content-Type"], resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        REGISTRY.unregister(usage)
    assert content_type.startswith("text/plain;")  # not OpenMetrics
    assert 'vllm:test_kv_cache_usage_perc{model_name="m"} 0.25' in body.splitlines()
