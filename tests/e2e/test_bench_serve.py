"""A short run of bench/serve.py, the benchmark users run: every deployment (the mesh, plain vLLM,
vllm-router over two vLLM servers) serves a few requests of every workload through vLLM's
benchmark client, the tables and the plot are written, and nothing it started is left running.

Runs before the session's mesh starts (first in this folder), so its five engines have the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.own_engines, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_quick_run_serves_every_workload_on_every_deployment_and_cleans_up(tmp_path, model_dir):
    marker = f"LLMESH_BENCH_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "serve.py"),
            "--quick",
            "--out",
            str(tmp_path),
            "--model-dir",
            str(model_dir),
        ],
        env={**os.environ, name: value},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for death in results["restarts"]:  # a baseline's vLLM server died starting (seen once in CI): say why
        warnings.warn(
            f"{death['process']} exited with {death['exit_code']} while starting:\n{death['log_tail']}", stacklevel=1
        )
    assert all(death["process"] != "mesh" for death in results["restarts"])
    points = results["points"]
    assert {(p["deployment"], p["workload"]) for p in points} == {
        (d, w) for d in ("mesh", "vllm", "vllm-router") for w in ("random", "prefix", "trace")
    }
    for p in points:
        assert p["completed"] == 4 and p["failed"] == 0 and not p["errors"], p
        assert p["total_output_tokens"] > 0 and p["cpu"], p
    table = (tmp_path / "serve.md").read_text()
    for deployment in ("mesh", "vllm", "vllm-router"):
        assert f"| random | 2 | {deployment} | 4 / 0 |" in table
    assert (tmp_path / "serve.png").stat().st_size > 10_000
    assert processes_with(marker) == [], "the benchmark left processes running"
