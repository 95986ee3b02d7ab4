"""Preemption under KV pressure: swap (reload from the kv-store) vs recompute vs the cost model's choice.

    .venv/bin/python bench/preemption.py [--model llmesh/tiny-llama] [--prompt 600] [--output 420]
                                         [--concurrency 3] [--repeats 3] [--max-model-len 2048]

Starts the mesh (the `make run` launcher, placement's balancing off) and three decode workers with
KV for one longest request (`--max-model-len`) (`MESH_KV_BLOCKS`), one per `MESH_KV_PREEMPTION` mode:
`recompute` (what vLLM does alone: the baseline), `swap` and `auto`. Each round prefills
`concurrency` requests and decodes them together on one worker, so vLLM preempts some and resumes
them later; the modes take turns. Reported per mode: the time to finish the round, the mean time
per output token, the choices the worker counted, and whether every output equals the first mode's
(greedy: they must agree).
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

from harness import BLOCK_SIZE, launch_mesh  # bench/harness.py and bench/serve.py (this folder is on sys.path)
from serve import prompt_ids

from llmesh.deploy.launcher import Child, start_service
from llmesh.engine.models import resolve_model
from llmesh.wire.bus import Bus
from llmesh.wire.messages import (
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    SamplingOptions,
    Subjects,
    WorkerInfo,
)

MODES = ("recompute", "swap", "auto")


async def heartbeats(bus: Bus) -> dict[str, WorkerInfo]:
    latest: dict[str, WorkerInfo] = {}

    async def on_heartbeat(info: WorkerInfo, blob) -> None:
        latest[info.worker_id] = info

    await bus.serve(Subjects.HEARTBEAT, on_heartbeat, traced=False)
    return latest


async def one_request(bus: Bus, model: str, prefill: str, decode: str, ids: list[int], output: int) -> list[int]:
    deadline = time.time() + 600
    sampling = SamplingOptions(max_tokens=output, temperature=0, ignore_eos=True)
    request_id = f"bench-{random.getrandbits(48):x}"
    result, _ = await bus.request(
        Subjects.worker("prefill", prefill),
        PrefillRequest(request_id=request_id, model=model, prompt_token_ids=ids, sampling=sampling, deadline=deadline),
        PrefillResult,
        timeout=600,
    )
    tokens = list(result.first.token_ids)
    replies = await bus.stream(
        Subjects.worker("decode", decode),
        DecodeRequest(
            request_id=request_id,
            model=model,
            prompt_token_ids=result.prompt_token_ids,
            output_token_ids=tokens[:1],
            sampling=sampling,
            kv=result.kv,
            fingerprint=result.fingerprint,
            deadline=deadline,
        ),
        deadline=deadline,
    )
    async for delta, _ in replies:
        tokens += delta.token_ids
    return tokens


async def bench(args: argparse.Namespace, work: Path) -> list[dict]:
    model_dir = Path.home() / ".cache" / "llmesh"
    resolve_model(args.model, model_dir)
    kv_blocks = -(-args.max_model_len // BLOCK_SIZE) + 1  # the fewest vLLM accepts: room for one longest request
    workers: list[Child] = []
    rows = []
    with launch_mesh(
        work,
        model_dir,
        600,
        MESH_MODEL=args.model,
        MESH_MAX_MODEL_LEN=str(args.max_model_len),
        MESH_REQUEST_TIMEOUT_S="600",
        MESH_PLACEMENT_BALANCE="0",
    ) as mesh:
        try:
            for mode in MODES:
                workers.append(
                    start_service(
                        "decode-worker",
                        mesh.service_env(
                            MESH_WORKER_ID=f"decode-{mode}", MESH_KV_BLOCKS=str(kv_blocks), MESH_KV_PREEMPTION=mode
                        ),
                        work / f"decode-{mode}.log",
                    )
                )
            bus = await Bus.connect(mesh.nats_url, "bench-preemption")
            latest = await heartbeats(bus)
            give_up = time.monotonic() + 600
            while not all(f"decode-{m}" in latest for m in MODES) or not any(
                i.role == "prefill" for i in latest.values()
            ):
                assert time.monotonic() < give_up, "workers did not start"
                await asyncio.sleep(0.5)
            prefill = next(i.worker_id for i in latest.values() if i.role == "prefill")
            reference: dict[int, list[int]] = {}
            results: dict[str, list[dict]] = {m: [] for m in MODES}
            kept: list[dict] = []  # every output, written to outputs.json for checking against a reference
            for rep in range(args.repeats + 1):  # the first round warms every worker up
                prompts = [prompt_ids(args.prompt, seed=1000 * rep + i) for i in range(args.concurrency)]
                for mode in MODES:
                    before = dict(latest[f"decode-{mode}"].preemptions)
                    started = time.perf_counter()
                    outputs = await asyncio.gather(
                        *(one_request(bus, args.model, prefill, f"decode-{mode}", ids, args.output) for ids in prompts)
                    )
                    elapsed = time.perf_counter() - started
                    print(f"round {rep} {mode}: {elapsed:.1f} s", file=sys.stderr, flush=True)
                    await asyncio.sleep(1.5)  # a heartbeat with the counts
                    after = latest[f"decode-{mode}"].preemptions
                    for i, out in enumerate(outputs):
                        reference.setdefault(1000 * rep + i, out)
                        kept.append({"mode": mode, "round": rep, "prompt_token_ids": prompts[i], "token_ids": out})
                    if rep:
                        results[mode].append(
                            {
                                "round_s": elapsed,
                                "tpot_ms": 1e3 * elapsed / args.output,
                                "choices": {k: after.get(k, 0) - before.get(k, 0) for k in after},
                                "exact": all(out == reference[1000 * rep + i] for i, out in enumerate(outputs)),
                            }
                        )
            for mode in MODES:
                row = {"mode": mode, **{k: [r[k] for r in results[mode]] for k in results[mode][0]}}
                rows.append(row)
                print(json.dumps(row), flush=True)
            (work / "outputs.json").write_text(json.dumps(kept))
            await bus.close()
        finally:
            for child in workers:
                child.stop()
    return rows


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--output", type=int, default=420)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-bench-preemption-"))
    rows = asyncio.run(bench(args, work))
    base = statistics.median(next(r for r in rows if r["mode"] == "recompute")["round_s"])
    print(
        f"\n{args.concurrency} requests of {args.prompt}+{args.output} tokens at once on a worker with KV for one; "
        f"median (min–max) of {args.repeats} rounds; logs in {work}\n"
    )
    print("| preemption | round s | per output token ms | vs always-recompute | choices | outputs equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        choices: dict[str, int] = {}
        for c in r["choices"]:
            for k, v in c.items():
                choices[k] = choices.get(k, 0) + v
        print(
            f"| {r['mode']} | {spread(r['round_s'])} | {spread(r['tpot_ms'])} | "
            f"{base / statistics.median(r['round_s']):.2f}× | {choices} | {all(r['exact'])} |"
        )


if __name__ == "__main__":
    main()
