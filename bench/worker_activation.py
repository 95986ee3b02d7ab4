"""A mesh worker activated in a pre-started process (llmesh.engine.standby) against its cold start, in one
run, alternating (issue 33, part 4: activation <= 0.3x of a cold start).

    .venv/bin/python bench/worker_activation.py [--models llmesh/tiny-llama llmesh/small-llama] [--repeats 3]
                                                [--out FILE]

Starts a nats-server and a kv-store shard, then for each model and repetition, alternating:
- cold: `python -m llmesh_decode` started as the launcher starts it; timed from the start to the worker's
  first heartbeat (engine built with its KV connector, warm-up request run, NATS and the store reached);
- standby: `python -m llmesh.engine.standby` started and left to prepare (not timed, as a host's pool
  keeps it ready), then the command that makes it that decode worker; timed from the command to the
  first heartbeat.
Both on the cores `make run` gives decode workers. Prints medians, spread and the ratio; --out writes JSON.
bench/activation.py measures the bare engine's phases (docs/activation-notes.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from llmesh.deploy.launcher import activate, engine_cores, standby_ready, start_nats, start_service, start_standby
from llmesh.wire.bus import Bus
from llmesh.wire.messages import Subjects, WorkerInfo


async def first_heartbeat(nats_url: str, worker_id: str, started: float, timeout: float = 600) -> float:
    """Seconds from `started` (monotonic) to `worker_id`'s first heartbeat."""
    bus = await Bus.connect(nats_url, "bench-activation")
    seen = asyncio.get_running_loop().create_future()

    async def on_heartbeat(info: WorkerInfo, blob) -> None:
        if info.worker_id == worker_id and not seen.done():
            seen.set_result(time.monotonic())

    try:
        await bus.serve(Subjects.HEARTBEAT, on_heartbeat, traced=False)
        return await asyncio.wait_for(seen, timeout) - started
    finally:
        await bus.close()


def one(mode: str, model: str, env: dict[str, str], logs: Path, n: int) -> float:
    worker_id = f"decode-{mode}-{n}"
    env = env | {"MESH_MODEL": model, "MESH_WORKER_ID": worker_id}
    log = logs / f"{worker_id}.log"
    if mode == "cold":
        started = time.monotonic()
        child = start_service("decode-worker", env, log)
        try:
            return asyncio.run(first_heartbeat(env["MESH_NATS_URL"], worker_id, started))
        finally:
            child.stop(30)
    standby = start_standby({k: v for k, v in env.items() if k == "MESH_CPU_CORES"}, log, worker_id)
    try:
        while not standby_ready(standby):
            assert standby.alive(), f"the standby process died (see {log})"
            time.sleep(0.2)
        started = time.monotonic()
        activate(standby, "decode-worker", env)
        return asyncio.run(first_heartbeat(env["MESH_NATS_URL"], worker_id, started))
    finally:
        standby.stop(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llmesh/tiny-llama", "llmesh/small-llama"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="worker-activation-"))
    nats, nats_url = start_nats(work, log_path=work / "nats.log")
    env = {"MESH_NATS_URL": nats_url, "MESH_DATA_DIR": str(work / "kv")} | engine_cores().get("decode-worker", {})
    store = start_service("kv-store", env | {"MESH_KV_SHARD": "0"}, work / "kv-store.log")
    runs: list[dict] = []
    try:
        for model in args.models:
            for n in range(args.repeats):
                for mode in ("cold", "standby") if n % 2 == 0 else ("standby", "cold"):
                    seconds = one(mode, model, env, work, len(runs))
                    runs.append({"model": model, "mode": mode, "seconds": seconds})
                    print(f"{model} {mode}: {seconds:.2f} s", flush=True)
    finally:
        store.stop()
        nats.stop()
    print("\n| model | cold start s (median, min-max) | standby activation s | ratio of medians |\n|---|---|---|---|")
    summary = {}
    for model in args.models:
        times = {m: [r["seconds"] for r in runs if r["model"] == model and r["mode"] == m] for m in ("cold", "standby")}
        cold, warm = statistics.median(times["cold"]), statistics.median(times["standby"])
        summary[model] = {"cold": times["cold"], "standby": times["standby"], "ratio": warm / cold}
        cells = [f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" for xs in times.values()]
        print(f"| {model} | {cells[0]} | {cells[1]} | {warm / cold:.3f} |")
    print(f"logs: {work}")
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
