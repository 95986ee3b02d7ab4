"""bench/autoscale.py's workload: the trace's arrivals compressed into the run's minutes, the same sample of its
requests every time, lengths capped."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # it imports bench/harness.py and serve.py, as a script run there does
spec = importlib.util.spec_from_file_location("bench_autoscale", ROOT / "bench" / "autoscale.py")
assert spec and spec.loader
autoscale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(autoscale)


def test_the_workload_compresses_the_trace_samples_it_alike_each_time_and_caps_lengths(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000 * t, "requests": [{"Prompt Length": 5000, "Output Length": 500, "prompt": "x"}] * 2}
        for t in range(0, 481, 4)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    every = autoscale.workload(trace, minutes=2, sample=1.0, max_output=64, seed=0)
    assert len(every) == 2 * len(rows) and every[-1][0] == 120.0 and every[2][0] == 1.0  # 8 min into 2
    assert {(p, o) for _, p, o in every} == {(2048, 64)}
    half = autoscale.workload(trace, minutes=2, sample=0.5, max_output=64, seed=0)
    assert half == autoscale.workload(trace, minutes=2, sample=0.5, max_output=64, seed=0)
    assert 0.3 * len(every) < len(half) < 0.7 * len(every)
