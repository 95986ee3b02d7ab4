"""Autoscaling against static provisioning at the peak, on AIBrix's `8min_up_and_down` workload (issue 33, part 8).

    .venv/bin/python bench/autoscale.py [--minutes 4] [--sample 0.35] [--peak 2] [--kv-blocks 24] [--out DIR]

Two configurations of the mesh (`make run`'s launcher, the tiny model, one prefill worker; none with
`--aggregated`, where the decode workers run whole requests), run one after the other on the same requests:
- static: `--peak` decode workers all along, what one provisions for the peak;
- autoscale: one decode worker, a host agent with a standby per role, and placement's autoscaling
  (`MESH_PLACEMENT_AUTOSCALE=1`, between 1 and `--peak` decode workers, freeness band `--low`/`--high`,
  windows `--window` to scale up and `--down-window` to scale down).
Each decode worker has `--kv-blocks` KV blocks, so that load shows in freeness (Llumnix's signal) at the
request rates this machine carries. The workload: the trace's arrival times compressed into `--minutes`,
a `--sample` of its requests (the same ones in both runs), each a streaming greedy completion of a prompt
of its `Prompt Length` tokens (random ids; the trace's text would tokenize differently for the tiny
vocabulary) and `Output Length` tokens (capped at `--max-output`). Reported: worker-seconds of decode
workers and of all workers (counted every second from placement's status, draining ones included until
they exit; standbys, which hold no engine, are not counted), TTFT P50/P99, requests lost, the scaling
decisions, and the ratios autoscale / static.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness import launch_mesh  # bench/harness.py and bench/serve.py (this folder is on sys.path)
from serve import prompt_ids, timed_completion

from llmesh.engine.models import resolve_model
from llmesh.wire.bus import Bus
from llmesh.wire.config import EMBEDDED_MODEL
from llmesh.wire.messages import PlacementRequest, PlacementStatus, Subjects

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "aibrix-workloads" / "8min_up_and_down.jsonl"


def workload(path: Path, minutes: float, sample: float, max_output: int, seed: int) -> list[tuple[float, int, int]]:
    """(send at, prompt tokens, output tokens) of the sampled requests, in order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    span = max(r["timestamp"] for r in rows) / 1000
    rng = random.Random(seed)
    out = []
    for row in rows:
        for req in row["requests"]:
            if rng.random() < sample:
                at = row["timestamp"] / 1000 * minutes * 60 / span
                out.append((at, min(req["Prompt Length"], 2048), max(1, min(req["Output Length"], max_output))))
    return out


async def run(url: str, nats_url: str, headers: dict, requests: list[tuple[float, int, int]]) -> dict:
    bus = await Bus.connect(nats_url, "bench-autoscale")
    counts: list[tuple[float, int, int]] = []  # (time, decode workers, all workers)
    done = asyncio.Event()

    async def count() -> PlacementStatus | None:
        status = None
        while not done.is_set():
            try:
                status, _ = await bus.request(
                    Subjects.PLACEMENT, PlacementRequest(op="status"), PlacementStatus, timeout=5
                )
                counts.append((time.monotonic(), sum(w.role == "decode" for w in status.workers), len(status.workers)))
            except Exception as exc:  # noqa: BLE001 a status missed is a second not counted, said below
                print(f"status: {exc}", file=sys.stderr)
            await asyncio.sleep(1.0)
        return status

    counting = asyncio.create_task(count())
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=httpx.Limits(max_connections=None)) as http:

        async def at(send_at: float, i: int, prompt: int, output: int):
            await asyncio.sleep(max(send_at - (time.monotonic() - start), 0))
            body = {
                "model": EMBEDDED_MODEL,
                "prompt": prompt_ids(prompt, seed=i),
                "max_tokens": output,
                "temperature": 0,
                "ignore_eos": True,
            }
            ttft, _, error = await timed_completion(http, url, body)
            return ttft, error

        results = await asyncio.gather(*(at(t, i, p, o) for i, (t, p, o) in enumerate(requests)))
    elapsed = time.monotonic() - start
    done.set()
    final = await counting
    await bus.close()
    ttfts = sorted(t for t, _ in results if t is not None)
    seconds = [b[0] - a[0] for a, b in zip(counts, counts[1:])]
    decisions = [e.model_dump() for e in (final.events if final else [])]
    return {
        "requests": len(requests),
        "failed": sum(t is None for t, _ in results),
        "errors": sorted({e for _, e in results if e}),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(int(0.99 * len(ttfts)), len(ttfts) - 1)],
        "seconds": elapsed,
        "decode_worker_s": sum(s * c[1] for s, c in zip(seconds, counts)),
        "worker_s": sum(s * c[2] for s, c in zip(seconds, counts)),
        "max_decode_workers": max(c[1] for c in counts),
        "decisions": decisions,
    }


def configuration(name: str, args: argparse.Namespace, work: Path, model_dir: Path, requests) -> dict:
    env = {
        "MESH_KV_BLOCKS": str(args.kv_blocks),
        "MESH_REQUEST_TIMEOUT_S": "600",
        "MESH_PLACEMENT_BALANCE": "0",
        "MESH_PLACEMENT_SCALE_LOW": str(args.low),
        "MESH_PLACEMENT_SCALE_HIGH": str(args.high),
    }
    if args.aggregated:
        env["MESH_MODELS"] = json.dumps([{"name": EMBEDDED_MODEL, "disaggregated": False}])
    if name == "static":
        env |= {"MESH_DECODE_WORKERS": str(args.peak), "MESH_HOST_AGENT": "0"}
    else:
        env |= {
            "MESH_DECODE_WORKERS": "1",
            "MESH_PLACEMENT_AUTOSCALE": "1",
            "MESH_PLACEMENT_SCALE_WINDOW_S": str(args.window),
            "MESH_PLACEMENT_SCALE_DOWN_WINDOW_S": str(args.down_window),
            "MESH_PLACEMENT_MAX_DECODE_WORKERS": str(args.peak),
        }
    with launch_mesh(work / name, model_dir, **env) as mesh:
        time.sleep(args.settle)  # the host agent's standbys get ready
        result = asyncio.run(run(mesh.url, mesh.nats_url, mesh.headers, requests))
    print(f"{name}: {json.dumps({k: v for k, v in result.items() if k != 'decisions'})}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--sample", type=float, default=0.35)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument(
        "--peak", type=int, default=2, help="decode workers of the static configuration (autoscale's max)"
    )
    parser.add_argument("--kv-blocks", type=int, default=24)
    parser.add_argument("--low", type=float, default=6.0)
    parser.add_argument("--high", type=float, default=16.0)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument(
        "--down-window", type=float, default=30.0, help="scale-down's window (the trace runs at 2x with --minutes 4)"
    )
    parser.add_argument("--settle", type=float, default=30.0, help="seconds between the mesh's health and the load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument(
        "--aggregated",
        action="store_true",
        help="the model served aggregated: decode workers alone, running whole requests (no prefill worker)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-autoscale-"))
    model_dir = work / "models"
    resolve_model(EMBEDDED_MODEL, model_dir)
    requests = workload(args.trace, args.minutes, args.sample, args.max_output, args.seed)
    print(f"{len(requests)} requests over {args.minutes} min; work in {work}", flush=True)
    results = {name: configuration(name, args, work, model_dir, requests) for name in ("static", "autoscale")}
    s, a = results["static"], results["autoscale"]
    lines = [
        "| configuration | decode worker-s | worker-s | max decode workers | TTFT P50 ms | TTFT P99 ms | failed |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {n} | {r['decode_worker_s']:.0f} | {r['worker_s']:.0f} | {r['max_decode_workers']} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['failed']} / {r['requests']} |"
            for n, r in results.items()
        ),
        "| autoscale / static | "
        + " | ".join(
            f"{a[k] / s[k]:.2f}" if k else "" for k in ("decode_worker_s", "worker_s", "", "ttft_p50_ms", "ttft_p99_ms")
        )
        + " | |",
    ]
    scaled = [
        f"{e['kind']} {e['reason']} {e['detail'].get('worker_id')}: {e['detail'].get('outcome')}"
        for e in a["decisions"]
        if e["reason"] in ("scale-up", "scale-down")
    ]
    report = "\n".join(lines) + "\n\nautoscale decisions: " + ("; ".join(scaled) or "none")
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "autoscale.json").write_text(json.dumps(results, indent=1))
        (args.out / "autoscale.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
