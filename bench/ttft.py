"""TTFT and time per output token: the mesh against one monolithic vLLM engine, side by side.

    .venv/bin/python bench/ttft.py [--models llmesh/tiny-llama llmesh/small-llama] [--lengths 128 512 2048]

For each model: starts the mesh (the `make run` launcher) and a monolithic engine (no
connector) on the same machine, then alternates requests between them at each prompt length,
letting every engine go idle before the next request, and prints medians and the ratio
mesh/monolithic. On a 2-core host the mesh's engines get one core each and the monolithic
engine one core (vLLM's default there), so each side computes on one core at a time. The mesh's
time is split using its trace spans: router.prefill (queueing + prefill compute + KV save),
kv.load (decode fetching KV), and the rest (decode start, first token, HTTP).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import launch_mesh  # bench/harness.py and bench/serve.py (this folder is on sys.path when a script runs)
from serve import prompt_ids

from llmesh.engine.models import resolve_model

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_TOKENS = 32
IDLE_S = 1.5  # a vLLM engine busy-polls for 1 s after its last step: let it go idle between runs


def mesh_request(http: httpx.Client, url: str, ids: list[int]) -> tuple[float, float, float, str]:
    """TTFT, time per output token after the first, first-to-second token gap, trace id.

    `http` (with the mesh's API key) is made once: building an httpx client (its TLS context) costs ~25 ms, not
    the mesh's.
    """
    trace_id = f"{random.getrandbits(128):032x}"
    started = time.perf_counter()
    stamps = []
    with http.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=300,
        headers={"traceparent": f"00-{trace_id}-{f'{random.getrandbits(64):016x}'}-01"},
        json={"model": MODEL, "prompt": ids, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True},
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return (stamps[0] - started, (stamps[-1] - stamps[0]) / (OUTPUT_TOKENS - 1), stamps[1] - stamps[0], trace_id)


def span_breakdown(trace_dir: Path, trace_id: str) -> dict[str, float]:
    spans = []
    for path in trace_dir.glob("*.jsonl"):
        spans += [json.loads(line) for line in path.read_text().splitlines() if trace_id in line]

    def seconds(name: str) -> float:
        from datetime import datetime

        total = 0.0
        for s in spans:
            if s["name"] == name:
                total += (
                    datetime.fromisoformat(s["end_time"].replace("Z", "+00:00"))
                    - datetime.fromisoformat(s["start_time"].replace("Z", "+00:00"))
                ).total_seconds()
        return total

    return {
        "prefill": seconds("router.prefill"),
        "kv_load": seconds("kv.load"),
        "prefill_compute": seconds("prefill-worker prefill"),
        "kv_save_wait": seconds("kv.save_wait"),
    }


def main() -> None:
    global MODEL
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["llmesh/tiny-llama", "llmesh/small-llama"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-bench-"))
    model_dir = Path.home() / ".cache" / "llmesh"
    rows = []
    for MODEL in args.models:
        path = resolve_model(MODEL, model_dir)
        with (
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests/e2e/reference_engine.py"), path, "2304", "128"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(work / "mono.log", "w"),
                text=True,
                start_new_session=True,
                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
            ) as mono,  # (started first: it loads while the mesh does)
            launch_mesh(
                work / MODEL.replace("/", "_"),
                model_dir,
                600,
                MESH_MODEL=MODEL,
                MESH_MAX_MODEL_LEN="2304",
                MESH_TRACE_DIR=str(work / "traces"),
            ) as mesh,
            httpx.Client(headers=mesh.headers) as http,
        ):
            assert mono.stdout.readline().strip(), "monolithic engine failed to start"
            for length in args.lengths:
                m_ttft, m_tpot, m_gap, o_ttft, o_tpot, o_gap, parts = [], [], [], [], [], [], []
                for rep in range(args.repeats + 1):  # the first of each pair warms caches and is dropped
                    ids = prompt_ids(length, seed=1000 * length + rep)
                    ttft, tpot, gap, trace_id = mesh_request(http, mesh.url, ids)
                    time.sleep(IDLE_S)
                    mono.stdin.write(
                        json.dumps({"prompt_token_ids": ids, "max_tokens": OUTPUT_TOKENS, "timing": True}) + "\n"
                    )
                    mono.stdin.flush()
                    timing = json.loads(mono.stdout.readline())
                    if rep:
                        m_ttft.append(ttft), m_tpot.append(tpot), m_gap.append(gap)
                        o_ttft.append(timing["ttft"]), o_tpot.append(timing["tpot"]), o_gap.append(timing["gap"])
                        parts.append(span_breakdown(work / "traces", trace_id))
                    time.sleep(IDLE_S)
                med = statistics.median
                row = {
                    "model": MODEL,
                    "prompt_tokens": length,
                    "ttft_mesh_ms": 1e3 * med(m_ttft),
                    "ttft_mono_ms": 1e3 * med(o_ttft),
                    "ttft_ratio": med(m_ttft) / med(o_ttft),
                    "tpot_mesh_ms": 1e3 * med(m_tpot),
                    "tpot_mono_ms": 1e3 * med(o_tpot),
                    "tpot_ratio": med(m_tpot) / med(o_tpot),
                    "second_token_mesh_ms": 1e3 * med(m_gap),
                    "second_token_mono_ms": 1e3 * med(o_gap),
                    "prefill_ms": 1e3 * med(p["prefill"] for p in parts),
                    "prefill_compute_ms": 1e3 * med(p["prefill_compute"] for p in parts),
                    "kv_save_wait_ms": 1e3 * med(p["kv_save_wait"] for p in parts),
                    "kv_load_ms": 1e3 * med(p["kv_load"] for p in parts),
                }
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print(
        "\n| model | prompt | TTFT mesh ms | TTFT mono ms | ratio | TPOT mesh ms | TPOT mono ms | ratio |"
        " 1st→2nd token mesh ms | mono ms | router.prefill ms | prefill worker ms | kv.save_wait ms |"
        " kv.load ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['prompt_tokens']} | {r['ttft_mesh_ms']:.1f} | {r['ttft_mono_ms']:.1f} | "
            f"{r['ttft_ratio']:.2f} | {r['tpot_mesh_ms']:.2f} | {r['tpot_mono_ms']:.2f} | {r['tpot_ratio']:.2f} | "
            f"{r['second_token_mesh_ms']:.1f} | {r['second_token_mono_ms']:.1f} | {r['prefill_ms']:.1f} | "
            f"{r['prefill_compute_ms']:.1f} | {r['kv_save_wait_ms']:.1f} | {r['kv_load_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
