"""bench/control_plane.py's front-door ratios, on synthetic points (no mesh started)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_control_plane", ROOT / "bench" / "control_plane.py")
assert spec and spec.loader
control_plane = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
spec.loader.exec_module(control_plane)


def point(deployment: str, rate: float, cpu: dict[str, float], own: dict[str, float] | None = None) -> dict:
    return {
        "deployment": deployment,
        "workers": 4,
        "rate": rate,
        "cpu_ms_per_request": cpu,
        "door_cpu_ms_per_own_request": own or {},
    }


def test_the_mesh_routers_cpu_a_request_is_set_beside_each_peers_front_door_at_the_same_point():
    points = [
        point("mesh", 25, {"mesh:decode": 14.0, "mesh:router": 9.0}),
        point("vllm-router", 25, {"modelled-server-0": 2.9, "vllm-router": 3.6}),
        point("dynamo", 25, {"dynamo-frontend": 4.5}),
        point("mesh", 50, {"mesh:router": 8.0}),
    ]
    assert control_plane.door_ratios(points) == [
        "front door CPU ms a request, workers=4 rate=25: mesh:router 9.00, vllm-router 3.60, dynamo-frontend 4.50 "
        "(the mesh's router 2.50x vllm-router's, 2.00x dynamo-frontend's)",
        "front door CPU ms a request, workers=4 rate=50: mesh:router 8.00",
    ]


def test_several_routers_are_counted_together():
    mesh = point("mesh", 25, {"mesh:router": 6.0, "router-2": 6.5}, own={"mesh:router": 12.0, "router-2": 13.0})
    (line,) = control_plane.door_ratios([mesh, point("vllm-router", 25, {"vllm-router": 5.0})])
    assert line.endswith("mesh:router 12.50, vllm-router 5.00 (the mesh's router 2.50x vllm-router's)")
