"""Prism's model placement by KV pressure (Algorithm 1) and idle eviction (llmesh.policies.prism)."""

import pytest

from llmesh.policies.prism import Device, ModelDemand, idle_evictions, kv_pressure, kv_shares, place_models

GB = 1 << 30
TWO = [Device("a", 10 * GB), Device("b", 10 * GB)]


def m(name, rate, slo_s=1.0, weights_gb=2, parts=1):
    return ModelDemand(name, rate, slo_s, weights_gb * GB, parts)


def test_kv_pressure_is_rate_over_slo_per_byte_of_kv_and_infinite_without_kv_memory():
    assert kv_pressure(4.0, 2 * GB) == pytest.approx(2.0 / GB)
    assert kv_pressure(1.0, 0) == float("inf")


@pytest.mark.parametrize(
    "models, expected",
    [
        # the busiest first, on the emptier device; the next on the other; the third where pressure is lowest
        ([m("x", 8), m("y", 4), m("z", 1)], {"x": ("a",), "y": ("b",), "z": ("b",)}),
        # rate over SLO, not rate: y's tight SLO weighs more than x's rate
        ([m("x", 4, slo_s=2.0), m("y", 3, slo_s=0.5)], {"y": ("a",), "x": ("b",)}),
        # a model's tensor-parallel parts go on different devices
        ([m("big", 1, weights_gb=4, parts=2), m("small", 1)], {"big": ("a", "b"), "small": ("a",)}),
        # weights that fit nowhere leave the model out, and take nothing from the others
        ([m("huge", 9, weights_gb=12), m("x", 1)], {"x": ("a",)}),
        ([m("wide", 9, parts=3), m("x", 1)], {"x": ("a",)}),
    ],
)
def test_each_model_goes_where_kv_pressure_is_lowest(models, expected):
    assert place_models(models, TWO) == expected


def test_a_placed_model_moves_only_when_the_gain_passes_the_threshold():
    models = [m("x", 8), m("y", 4)]
    crowded = {"x": ["a"], "y": ["a"]}  # both on a, b empty
    # on its own, y would go to b; how much that gains in pressure:
    gain = kv_pressure(12, 6 * GB) - kv_pressure(4, 8 * GB)
    assert place_models(models, TWO, crowded, move_threshold=gain * 2) == {"x": ("a",), "y": ("a",)}
    assert place_models(models, TWO, crowded, move_threshold=gain / 2) == {"x": ("a",), "y": ("b",)}


def test_placement_is_deterministic_and_reruns_to_the_same_answer():
    models = [m(f"m{i}", rate=1 + i % 3, slo_s=0.5 + i % 2) for i in range(8)]
    devices = [Device(f"d{i}", 12 * GB) for i in range(3)]
    first = place_models(models, devices)
    assert set(first) == {mm.name for mm in models}
    assert place_models(models, devices, first, move_threshold=1e-12) == first


def test_idle_models_are_evicted_only_where_memory_is_short_larger_slos_first():
    models = [m("chat", 1, slo_s=1.0), m("batch", 1, slo_s=10.0), m("code", 1, slo_s=5.0), m("elsewhere", 1)]
    placement = {"chat": ["a"], "batch": ["a"], "code": ["a"], "elsewhere": ["b"]}
    idle = {"chat": 600.0, "batch": 600.0, "code": 600.0, "elsewhere": 600.0}
    # a lacks one model's weights: the idle one with the largest SLO goes, b (not short) keeps its own
    assert idle_evictions(models, placement, idle, {"a": 1 * GB}, idle_after_s=300) == ["batch"]
    assert idle_evictions(models, placement, idle, {"a": 3 * GB}, idle_after_s=300) == ["batch", "code"]
    assert idle_evictions(models, placement, {**idle, "batch": 10.0}, {"a": 1 * GB}, idle_after_s=300) == ["code"]
    assert idle_evictions(models, placement, idle, {}, idle_after_s=300) == []


def test_kv_memory_is_split_by_rate_over_slo_and_a_model_without_a_rate_counts_as_the_least_weighted():
    assert kv_shares({"a": 3.0, "b": 1.0}, 8000) == {"a": 6000, "b": 2000}
    assert kv_shares({"a": 0.0, "b": 0.0}, 8000) == {"a": 4000, "b": 4000}
    assert kv_shares({"a": 3.0, "b": 1.0, "idle": 0.0}, 10000) == {"a": 6000, "b": 2000, "idle": 2000}
    assert kv_shares({"a": 1.0}, -5) == {"a": 0}  # nothing free: the engine's own minimum
    assert kv_shares({}, 8000) == {}
