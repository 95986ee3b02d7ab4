"""TTFT and time per output token: the mesh against one monolithic vLLM engine, side by side.

    .venv/bin/python bench/ttft.py [--models llmesh/tiny-llama llmesh/small-llama] [--lengths 128 512 2048]

For each model: starts the mesh (the `make run` launcher) and a monolithic engine (no
connector) on the same machine, then alternates requests between them at each prompt length
and prints medians and the ratio mesh/monolithic. The mesh's time is split using its trace
spans: router.prefill (queueing + prefill compute + KV save), kv.load (decode fetching KV),
and the rest (decode start, first token, HTTP).
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

from llmesh.launcher import Child, free_port, wait_healthy
from llmesh.models import resolve_model

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_TOKENS = 32


def prompt_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 2000) for _ in range(length - 1)]


def mesh_request(url: str, ids: list[int]) -> tuple[float, float, str]:
    trace_id = "%032x" % random.getrandbits(128)
    started = time.perf_counter()
    first = last = None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=300,
                      headers={"traceparent": f"00-{trace_id}-{'%016x' % random.getrandbits(64)}-01"},
                      json={"model": MODEL, "prompt": ids, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
                            "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
    return first - started, (last - first) / (OUTPUT_TOKENS - 1), trace_id


def span_breakdown(trace_dir: Path, trace_id: str) -> dict[str, float]:
    spans = []
    for path in trace_dir.glob("*.jsonl"):
        spans += [json.loads(line) for line in path.read_text().splitlines() if trace_id in line]

    def seconds(name: str) -> float:
        from datetime import datetime

        total = 0.0
        for s in spans:
            if s["name"] == name:
                total += (datetime.fromisoformat(s["end_time"].replace("Z", "+00:00"))
                          - datetime.fromisoformat(s["start_time"].replace("Z", "+00:00"))).total_seconds()
        return total

    return {"prefill": seconds("router.prefill"), "kv_load": seconds("kv.load"),
            "prefill_compute": seconds("prefill-worker prefill")}


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
        port, nats_port = free_port(), free_port()
        env = {"MESH_MODEL": MODEL, "MESH_MAX_MODEL_LEN": "2304", "MESH_TRACE_DIR": str(work / "traces"),
               "MESH_MODEL_DIR": str(model_dir)}
        mesh = Child("mesh", [sys.executable, "-m", "llmesh.launcher", "--port", str(port), "--nats-port",
                              str(nats_port), "--logs", str(work / "logs")], env=env, log_path=work / "launcher.log")
        mono = subprocess.Popen([sys.executable, str(ROOT / "tests/e2e/reference_engine.py"), path, "2304", "128"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(work / "mono.log", "w"),
                                text=True, start_new_session=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
        try:
            assert mono.stdout.readline().strip(), "monolithic engine failed to start"
            wait_healthy(f"http://127.0.0.1:{port}", 600, [mesh])
            for length in args.lengths:
                m_ttft, m_tpot, o_ttft, o_tpot, parts = [], [], [], [], []
                for rep in range(args.repeats + 1):  # the first of each pair warms caches and is dropped
                    ids = prompt_ids(length, seed=1000 * length + rep)
                    ttft, tpot, trace_id = mesh_request(f"http://127.0.0.1:{port}", ids)
                    mono.stdin.write(json.dumps({"prompt_token_ids": ids, "max_tokens": OUTPUT_TOKENS,
                                                 "timing": True}) + "\n")
                    mono.stdin.flush()
                    timing = json.loads(mono.stdout.readline())
                    if rep:
                        m_ttft.append(ttft), m_tpot.append(tpot)
                        o_ttft.append(timing["ttft"]), o_tpot.append(timing["tpot"])
                        time.sleep(0.2)
                        parts.append(span_breakdown(work / "traces", trace_id))
                med = statistics.median
                row = {"model": MODEL, "prompt_tokens": length, "ttft_mesh_ms": 1e3 * med(m_ttft),
                       "ttft_mono_ms": 1e3 * med(o_ttft), "ttft_ratio": med(m_ttft) / med(o_ttft),
                       "tpot_mesh_ms": 1e3 * med(m_tpot), "tpot_mono_ms": 1e3 * med(o_tpot),
                       "tpot_ratio": med(m_tpot) / med(o_tpot),
                       "prefill_ms": 1e3 * med(p["prefill"] for p in parts),
                       "prefill_compute_ms": 1e3 * med(p["prefill_compute"] for p in parts),
                       "kv_load_ms": 1e3 * med(p["kv_load"] for p in parts)}
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        finally:
            mono.stdin.close()
            mono.wait(60)
            mesh.stop(30)
    print("\n| model | prompt | TTFT mesh ms | TTFT mono ms | ratio | TPOT mesh ms | TPOT mono ms | ratio |"
          " router.prefill ms | prefill compute ms | kv.load ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['prompt_tokens']} | {r['ttft_mesh_ms']:.1f} | {r['ttft_mono_ms']:.1f} | "
              f"{r['ttft_ratio']:.2f} | {r['tpot_mesh_ms']:.2f} | {r['tpot_mono_ms']:.2f} | {r['tpot_ratio']:.2f} | "
              f"{r['prefill_ms']:.1f} | {r['prefill_compute_ms']:.1f} | {r['kv_load_ms']:.1f} |")


if __name__ == "__main__":
    main()
