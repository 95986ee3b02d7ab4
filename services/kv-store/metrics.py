"""Prometheus metrics of one kv-store shard, read from the store at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmesh.wire.messages import KvStats

# name, help, kind, {label value: KvStats field}; a gauge or counter labelled by tier where it has tiers
_METRICS = [
    ("llmesh_kv_bytes", "Bytes held, by tier", "gauge", {"memory": "bytes", "ssd": "ssd_bytes"}),
    ("llmesh_kv_chunks", "Chunks held, by tier", "gauge", {"memory": "chunks", "ssd": "ssd_chunks"}),
    (
        "llmesh_kv_capacity_bytes",
        "Capacity, by tier",
        "gauge",
        {"memory": "capacity_bytes", "ssd": "ssd_capacity_bytes"},
    ),
    ("llmesh_kv_hits", "Gets answered, by tier", "counter", {"memory": "memory_hits", "ssd": "ssd_hits"}),
    ("llmesh_kv_misses", "Gets of chunks held by no tier", "counter", {"": "misses"}),
    ("llmesh_kv_pinned_bytes", "Memory bytes pinned by live leases", "gauge", {"": "pinned_bytes"}),
    ("llmesh_kv_evictions", "Chunks dropped for good", "counter", {"": "evictions"}),
    ("llmesh_kv_demotions", "Chunks moved from memory to SSD", "counter", {"": "demotions"}),
    ("llmesh_kv_promotions", "Chunks moved from SSD to memory", "counter", {"": "promotions"}),
    ("llmesh_kv_ssd_corrupt", "SSD chunks dropped as unreadable", "counter", {"": "ssd_corrupt"}),
    ("llmesh_kv_ssd_enabled", "1 while the SSD tier works", "gauge", {"": "ssd_enabled"}),
    ("llmesh_kv_put_bytes", "Bytes received by puts (rate = put throughput)", "counter", {"": "bytes_put"}),
    ("llmesh_kv_get_bytes", "Bytes sent by gets (rate = get throughput)", "counter", {"": "bytes_got"}),
]


class _StoreCollector:
    def __init__(self, stats: Callable[[], KvStats], shard: str):
        self._stats, self._shard = stats, shard

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, kind, fields in _METRICS:
            tiered = "" not in fields
            labels = ["shard", "tier"] if tiered else ["shard"]
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)
            for tier, field in fields.items():
                family.add_metric([self._shard, tier] if tiered else [self._shard], float(getattr(stats, field)))
            yield family


def store_registry(stats: Callable[[], KvStats], shard: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_StoreCollector(stats, shard))
    return registry


def serve_metrics(stats: Callable[[], KvStats], shard: str, port: int, host: str = "127.0.0.1") -> CollectorRegistry:
    registry = store_registry(stats, shard)
    start_http_server(port, addr=host, registry=registry)
    return registry
