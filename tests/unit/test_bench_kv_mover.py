"""bench/kv_mover.py, the GPU benchmark, runs here too: small shapes on the CPU, importing neither vLLM
nor an installed llmesh (a GPU machine that has only torch runs it as it is)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_on_small_shapes_and_reports_every_row(tmp_path):
    out = tmp_path / "kv_mover.json"
    # -I: no site customisation and no PYTHONPATH; the venv's torch and numpy still import
    subprocess.run(
        [sys.executable, "-I", str(ROOT / "bench" / "kv_mover.py"), "--smoke", "--out", str(out)],
        check=True,
        timeout=240,
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert not result["imports_vllm_or_llmesh"]
    assert result["inexact_rows"] == [] and len([row for row in result["rows"] if row.get("exact")]) == 5
    rows = {row["row"]: row for row in result["rows"]}
    assert (
        len([r for r in rows if r.startswith("decode")]) == 2 and len([r for r in rows if r.startswith("prefill")]) == 2
    )
    assert all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in rows.values() if "ratio" in row)
    assert len([r for r in rows if r.startswith("load")]) == 3
    assert all(row["gb_per_s"] > 0 for row in rows.values() if "gb_per_s" in row)
