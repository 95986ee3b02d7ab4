"""The committed Grafana dashboard reads only metrics that the mesh's services register.

Registries are the real ones, built in-process: the router's, a kv-store shard's, a length
predictor replica's and a placement replica's. The workers' `vllm:*` metrics are vLLM's own
Prometheus stat logger's, read from its source (importing vLLM would take seconds).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import CollectorRegistry

from llmesh.wire.messages import KvStats
from llmesh_kvstore.metrics import store_registry
from llmesh_lengthpred.service import LengthPredictorService
from llmesh_lengthpred.settings import LengthPredictorSettings
from llmesh_placement.service import PlacementService
from llmesh_placement.settings import PlacementSettings
from llmesh_router import metrics as router_metrics
from llmesh_router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "llmesh.json"
DATASOURCES = ROOT / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROMETHEUS = ROOT / "docker" / "prometheus" / "prometheus.yml"
VLLM_METRICS = Path(importlib.util.find_spec("vllm").origin).parent / "v1" / "metrics"

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# PromQL words that are neither functions (those are followed by "(") nor metric names
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
LABEL_LISTS = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, ranges (with $__rate_interval)
    expr = re.sub(LABEL_LISTS, "", expr)
    return {
        m.group()
        for m in re.finditer(r"[A-Za-z_:][\w:]*", expr)
        if m.group() not in KEYWORDS and not expr[m.end() :].lstrip().startswith("(")
    }


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry's metric families can expose, with or without children yet."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def vllm_engine_sample_names() -> set[str]:
    """Sample names of vLLM's Prometheus stat logger (a worker's /metrics, MESH_WORKER_METRICS_PORT)."""
    source = (VLLM_METRICS / "loggers.py").read_text()
    found = re.findall(r"_(gauge|counter|histogram)_cls\(\s*name=\"(vllm:\w+)\"", source)
    assert len(found) > 20, "vLLM's stat logger no longer declares its metrics as this test reads them"
    return {name.removesuffix("_total") + suffix for kind, name in found for suffix in SUFFIXES[kind]}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def registered() -> dict[str, set[str]]:
    stats = KvStats(chunks=0, bytes=0, capacity_bytes=0, pinned_bytes=0, hits=0, misses=0, evictions=0, puts=0)
    predictor = LengthPredictorService(
        None, SimpleNamespace(replica="r"), LengthPredictorSettings(_env_file=None), None, None
    )
    placement = PlacementService(None, PlacementSettings(_env_file=None, redis_url=""), "p")
    return {
        "router": sample_names(RouterMetrics().registry),
        "kv-store": sample_names(store_registry(lambda: stats, "0")),
        "length-predictor": sample_names(predictor.registry),
        "placement": sample_names(placement.registry),
        "workers": vllm_engine_sample_names(),
    }


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def used_metrics(dashboard: dict) -> dict[str, str]:
    """{metric name: where the dashboard reads it}."""
    used = {}
    for panel in panels(dashboard):
        for target in panel["targets"]:
            used.update({name: f"panel {panel['title']!r}" for name in metric_names(target["expr"])})
    for variable in dashboard["templating"]["list"]:
        for metric in re.findall(r"label_values\(([^,)]+),", variable["definition"]):
            used[metric.strip()] = f"variable {variable['name']!r}"
    return used


@pytest.mark.parametrize(
    "expr, names",
    [
        (
            'histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~"$m"}'
            "[$__rate_interval])))",
            {"vllm:time_to_first_token_seconds_bucket"},
        ),
        (
            "sum by (tier) (llmesh_kv_bytes) / sum by (tier) (llmesh_kv_capacity_bytes)",
            {"llmesh_kv_bytes", "llmesh_kv_capacity_bytes"},
        ),
        ('sum(a_total{kind!="scale"}) and on (instance) b == 1', {"a_total", "b"}),
        ("max by (role) (llmesh_live_workers)", {"llmesh_live_workers"}),
    ],
)
def test_metric_names_are_read_from_promql(expr, names):
    assert metric_names(expr) == names


def test_every_metric_the_dashboard_reads_is_registered_by_a_service(dashboard, registered):
    every = set().union(*registered.values())
    used = used_metrics(dashboard)
    assert len(used) > 20
    missing = {name: where for name, where in used.items() if name not in every}
    assert not missing, f"the dashboard reads metrics no service registers: {missing}"


def test_the_dashboard_shows_what_the_issue_asks(dashboard, registered):
    """TTFT and TPOT/ITL histograms, queue length, KV hits by tier, migrations, predictor accuracy,
    each from the service that owns it."""
    used = used_metrics(dashboard)
    wanted = {
        "router": [
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket",
            "vllm:request_time_per_output_token_seconds_bucket",
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "llmesh_decode_resumes_total",
        ],
        "kv-store": ["llmesh_kv_hits_total", "llmesh_kv_misses_total"],
        "placement": ["llmesh_placement_decisions_total"],
        "length-predictor": ["llmesh_length_exact_total", "llmesh_length_observed_total"],
        "workers": ["vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"],
    }
    for service, names in wanted.items():
        for name in names:
            assert name in used, f"the dashboard does not read {name}"
            assert name in registered[service], f"{service} does not register {name}"


def test_every_panel_queries_the_provisioned_prometheus(dashboard):
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    expected = {"type": "prometheus", "uid": source["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert len(panels(dashboard)) >= 12
    for panel in panels(dashboard):
        assert panel.get("datasource") == expected, f"panel {panel['title']!r}: datasource {panel.get('datasource')}"
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("datasource", expected) == expected and target["expr"].strip(), panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == expected, variable["name"]


def test_workers_keep_their_engine_metrics_under_an_engine_label_and_drop_the_routers_latencies(registered, dashboard):
    """Prometheus labels every worker series with its engine (prefill, decode); the router's request-level
    latencies have one source, the router, and every other vllm:* name the router exports too (queue and
    tokens, the usual autoscaling signals) is read by the dashboard with the engine label said: none, the
    mesh's; or some, the engines'."""
    (workers,) = [
        job for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"] if job["job_name"] == "workers"
    ]
    label, drop = workers["metric_relabel_configs"]
    assert label["source_labels"] == ["service"] and label["target_label"] == "engine"
    assert [re.sub(label["regex"], r"\1", s) for s in ("prefill-worker", "decode-worker-1")] == ["prefill", "decode"]
    assert drop["action"] == "drop" and drop["source_labels"] == ["__name__"]
    dropped = re.compile(drop["regex"])  # Prometheus anchors it at both ends: fullmatch
    router_vllm = {n for n in registered["router"] if n.startswith("vllm:")}
    assert len(router_vllm) >= 20
    kept = {n for n in router_vllm if not dropped.fullmatch(n)}
    assert {re.sub("(_total|_created)$", "", n) for n in kept} == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    }
    for panel in panels(dashboard):
        for target in panel["targets"]:
            for name in set(metric_names(target["expr"])) & kept:
                assert re.search(re.escape(name) + r'\{[^}]*engine(=|!=)""', target["expr"]), (panel["title"], name)
    from_workers = set(used_metrics(dashboard)) & registered["workers"] - router_vllm
    assert from_workers and not any(dropped.fullmatch(n) for n in from_workers), sorted(from_workers)


def test_the_routers_histograms_have_vllms_buckets():
    """Read from vLLM's buckets.py, which its stat logger draws every histogram's buckets from."""
    tree = ast.parse((VLLM_METRICS / "buckets.py").read_text())
    vllm_buckets = {
        node.target.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and node.target.id.endswith("_BUCKETS")
    }
    for name in ("TIME_TO_FIRST_TOKEN_BUCKETS", "INTER_TOKEN_LATENCY_BUCKETS", "REQUEST_LATENCY_BUCKETS"):
        assert getattr(router_metrics, name) == vllm_buckets[name], name
    metrics = RouterMetrics()
    for histogram, name in [
        (metrics.ttft, "TIME_TO_FIRST_TOKEN_BUCKETS"),
        (metrics.time_per_output_token, "INTER_TOKEN_LATENCY_BUCKETS"),
        (metrics.e2e, "REQUEST_LATENCY_BUCKETS"),
        (metrics.queue_time, "REQUEST_LATENCY_BUCKETS"),
    ]:
        assert tuple(histogram._upper_bounds[:-1]) == vllm_buckets[name], histogram._name
    # the inter-token histogram is the router's own collector over INTER_TOKEN_LATENCY_BUCKETS (checked above);
    # test_openai_api reads its exported bounds
