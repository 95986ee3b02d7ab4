"""TTFT with prefix reuse across prefill workers against full recompute, side by side.

    .venv/bin/python bench/prefix_reuse.py [--model llmesh/small-llama] [--length 2048] [--shared 1920]

Starts the mesh (`make run`'s launcher) plus a second prefill worker. Each repetition sends
request A to the first prefill worker, then to the second: B, which shares A's first
`--shared` tokens (their KV is in the kv-store, computed by the first worker), and C, of
the same length with no stored prefix. The prefill's answer carries the first token, so its
latency is the TTFT the mesh can reach (the router adds a few milliseconds to both). Prints
medians and the ratio reuse/recompute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from harness import launch_mesh  # bench/harness.py and bench/serve.py (this folder is on sys.path when a script runs)
from serve import prompt_ids

from llmesh.deploy.launcher import engine_cores, start_service
from llmesh.wire.bus import Bus
from llmesh.wire.messages import PrefillRequest, PrefillResult, SamplingOptions, Subjects, WorkerInfo, decode

IDLE_S = 1.5  # a vLLM engine busy-polls for 1 s after its last step: let it go idle between runs


async def prefill_workers(bus: Bus, count: int) -> list[str]:
    seen: set[str] = set()
    done = asyncio.Event()

    async def on_heartbeat(msg):
        info, _ = decode(msg.data, WorkerInfo)
        if info.role == "prefill":
            seen.add(info.worker_id)
            if len(seen) >= count:
                done.set()

    sub = await bus.nc.subscribe(Subjects.HEARTBEAT, cb=on_heartbeat)
    await asyncio.wait_for(done.wait(), 600)
    await sub.unsubscribe()
    return sorted(seen)


async def prefill_s(bus: Bus, model: str, worker: str, ids: list[int]) -> float:
    started = time.perf_counter()
    await bus.request(
        Subjects.worker("prefill", worker),
        PrefillRequest(
            request_id=f"bench-{time.monotonic_ns()}",
            model=model,
            prompt_token_ids=ids,
            sampling=SamplingOptions(max_tokens=1, temperature=0),
            deadline=time.time() + 120,
        ),
        PrefillResult,
        timeout=120,
    )
    return time.perf_counter() - started


async def measure(nats_url: str, model: str, length: int, shared: int, repeats: int) -> dict:
    bus = await Bus.connect(nats_url, "bench-prefix")
    try:
        workers = await prefill_workers(bus, 2)
        first, second = [w for w in workers if w != "prefill-second"][0], "prefill-second"
        reuse, recompute = [], []
        for rep in range(repeats + 1):  # the first round warms caches and is dropped
            a = prompt_ids(length, seed=7000 + rep)
            b = a[:shared] + prompt_ids(length - shared + 1, seed=8000 + rep)[1:]
            c = prompt_ids(length, seed=9000 + rep)
            await prefill_s(bus, model, first, a)
            await asyncio.sleep(IDLE_S)
            t_reuse = await prefill_s(bus, model, second, b)
            await asyncio.sleep(IDLE_S)
            t_full = await prefill_s(bus, model, second, c)
            await asyncio.sleep(IDLE_S)
            if rep:
                reuse.append(t_reuse), recompute.append(t_full)
        med = statistics.median
        return {
            "model": model,
            "prompt_tokens": length,
            "shared_tokens": shared,
            "ttft_reuse_ms": 1e3 * med(reuse),
            "ttft_recompute_ms": 1e3 * med(recompute),
            "ratio": med(reuse) / med(recompute),
        }
    finally:
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llmesh/small-llama")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--shared", type=int, default=1920)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-bench-prefix-"))
    model_dir = Path.home() / ".cache" / "llmesh"
    with launch_mesh(work, model_dir, 600, MESH_MODEL=args.model, MESH_MAX_MODEL_LEN="2304") as mesh:
        second = start_service(
            "prefill-worker",
            mesh.service_env(**engine_cores().get("prefill-worker", {}), MESH_WORKER_ID="prefill-second"),
            work / "prefill-second.log",
        )
        try:
            row = asyncio.run(measure(mesh.nats_url, args.model, args.length, args.shared, args.repeats))
        finally:
            second.stop(30)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    print("\n| model | prompt | shared prefix | TTFT reuse ms | TTFT recompute ms | ratio |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {row['model']} | {row['prompt_tokens']} | {row['shared_tokens']} | {row['ttft_reuse_ms']:.1f} | "
        f"{row['ttft_recompute_ms']:.1f} | {row['ratio']:.2f} |"
    )


if __name__ == "__main__":
    main()
