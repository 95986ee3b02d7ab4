"""The placement service at work: balancing a skewed workload, and draining a busy worker.

    .venv/bin/python bench/placement.py balance [--rates 1.5 2.5] [--reps 3] [--kv-blocks 40]
    .venv/bin/python bench/placement.py drain [--reps 3] [--requests 8]

`balance`: the mesh (the `make run` launcher) with two decode workers whose KV is small
(`--kv-blocks`), once with placement's balancing off and once on; the router's dispatch is its
default. Each point replays the same Poisson arrivals, through vLLM's benchmark client, of a mix of
short requests and a share of long ones (`--long-share`): dispatch cannot tell them apart, so long
ones pile up on a worker until it runs out of KV and vLLM preempts. Balancing (Llumnix) migrates
requests from the least free worker to the freest past its thresholds. Reported per configuration
and rate: P99 and mean TTFT and TPOT (median [min–max] over repetitions), the migrations placement
made and the preemptions the workers counted.

`drain`: the mesh with one decode worker (and no placement service but the one a `migrate` run
starts: placement empties any worker that says it drains); each repetition starts a second one, sends `--requests`
long streaming requests through the router and, once that worker holds two or more of them, drains
it in one of two ways, taking turns: `migrate` (the placement service's drain: its requests move to
the other worker, then it exits) and `wait` (a `DrainCommand` alone, what a deployment without
migration can do: it takes nothing new and exits when its requests end). Reported: time from the
command to the worker holding nothing and to its exit (which adds vLLM's engine shutdown),
requests lost (an error or fewer tokens than asked), and how many outputs equal the same request's
in the other mode (greedy; vLLM is not batch-invariant, so a near-tie may part two runs under
different batches, migration or not).
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
import psutil
import serve  # bench/serve.py: vLLM's client, deployments, tables (this folder is on sys.path when a script runs)
from harness import BLOCK_SIZE, LaunchedMesh, launch_mesh  # bench/harness.py
from serve import prompt_ids, spread

from llmesh.deploy.launcher import start_service
from llmesh.engine.models import resolve_model
from llmesh.wire.bus import Bus
from llmesh.wire.errors import MeshError
from llmesh.wire.messages import Ack, DrainCommand, PlacementRequest, PlacementStatus, Subjects, WorkerInfo


class Heartbeats:
    """The latest heartbeat of every worker."""

    def __init__(self) -> None:
        self.latest: dict[str, WorkerInfo] = {}

    async def watch(self, bus: Bus) -> Heartbeats:
        async def on_heartbeat(info: WorkerInfo, blob) -> None:
            self.latest[info.worker_id] = info

        await bus.serve(Subjects.HEARTBEAT, on_heartbeat, traced=False)
        return self

    async def until(self, test, timeout: float, what: str) -> None:
        give_up = time.monotonic() + timeout
        while not test(self.latest):
            if time.monotonic() > give_up:
                raise TimeoutError(f"no {what} after {timeout:.0f}s")
            await asyncio.sleep(0.1)

    def preemptions(self) -> int:
        return sum(sum(info.preemptions.values()) for info in self.latest.values() if info.role == "decode")


async def placement_status(bus: Bus) -> PlacementStatus:
    return (await bus.request(Subjects.PLACEMENT, PlacementRequest(op="status"), PlacementStatus, timeout=10))[0]


# ---- balance ------------------------------------------------------------------------------------------------------


def skewed_trace(
    path: Path, requests: int, rate: float, seed: int, long_share: float, short: tuple[int, int], long: tuple[int, int]
) -> Path:
    """Poisson arrivals at `rate` of short and (a `long_share` of) long requests, as vLLM's
    timed_trace jsonl (unique prompts: no prefix sharing)."""
    rng = random.Random(seed)
    at = 0.0
    with open(path, "w") as f:
        for i in range(requests):
            prompt, output = long if rng.random() < long_share else short
            hash_ids = [(seed * 10_000 + i) * 1000 + j for j in range(-(-prompt // 16))]
            f.write(
                json.dumps({"timestamp": at, "input_length": prompt, "output_length": output, "hash_ids": hash_ids})
                + "\n"
            )
            at += rng.expovariate(rate)
    return path


async def balance_points(
    args: argparse.Namespace, balanced: bool, mesh: LaunchedMesh, model_path: str, work: Path, log
) -> list[dict]:
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_path)
    deployment = serve.Deployment("mesh", mesh.url, [mesh.launcher], headers=mesh.headers)
    bus = await Bus.connect(mesh.nats_url, "bench-balance")
    beats = await Heartbeats().watch(bus)
    points = []
    try:
        await beats.until(lambda seen: sum(i.role == "decode" for i in seen.values()) == 2, 600, "two decode workers")
        for rep in range(args.reps + 1):  # the first repetition warms up, unrecorded
            for k, rate in enumerate(args.rates):
                seed = 100 * rep + k
                path = skewed_trace(
                    work / f"skewed-{seed}.jsonl",
                    args.requests,
                    rate,
                    seed,
                    args.long_share,
                    tuple(args.short),
                    tuple(args.long),
                )
                client = serve.client_args(
                    [
                        "--backend",
                        "vllm",
                        "--model",
                        model_path,
                        "--served-model-name",
                        args.model,
                        "--tokenizer",
                        model_path,
                        "--num-prompts",
                        str(args.requests),
                        "--seed",
                        str(seed),
                        "--ignore-eos",
                        "--temperature",
                        "0",
                        "--request-rate",
                        str(rate),
                        "--dataset-name",
                        "timed_trace",
                        "--dataset-path",
                        str(path),
                    ]
                )
                prompts = serve.sample(client, tokenizer)
                await asyncio.sleep(serve.IDLE_S)
                moves_before, preempted_before = (await placement_status(bus)).decisions, beats.preemptions()
                point = await asyncio.to_thread(
                    serve.measure, deployment, client, prompts, tokenizer, {"ttft": 1000.0, "tpot": 50.0}, log
                )
                await asyncio.sleep(1.5)  # a heartbeat with the last counts
                moves = {k: n - moves_before.get(k, 0) for k, n in (await placement_status(bus)).decisions.items()}
                point |= {
                    "balance": balanced,
                    "rep": rep,
                    "rate": rate,
                    "migrations": moves.get("migrate/accepted", 0),
                    "preemptions": beats.preemptions() - preempted_before,
                    "decisions": moves,
                }
                print(
                    f"balance {'on' if balanced else 'off'} rep {rep} {rate:g} req/s: {point['completed']} ok "
                    f"{point['failed']} failed, P99 TTFT {point['p99_ttft_ms']:.0f} ms, P99 TPOT "
                    f"{point['p99_tpot_ms']:.1f} ms, {point['migrations']} migrations, "
                    f"{point['preemptions']} preemptions",
                    file=sys.stderr,
                    flush=True,
                )
                if rep:
                    points.append(point)
    finally:
        await bus.close()
    return points


def balance(args: argparse.Namespace, work: Path, model_path: str) -> str:
    points = []
    log = open(work / "client.log", "w")
    for balanced in (False, True):
        with launch_mesh(
            work / f"balance-{int(balanced)}",
            Path(model_path).parent,
            MESH_MODEL=args.model,
            MESH_REQUEST_TIMEOUT_S="600",
            MESH_DECODE_WORKERS="2",
            MESH_KV_BLOCKS=str(args.kv_blocks),
            MESH_PLACEMENT_BALANCE=str(int(balanced)),
            MESH_PLACEMENT_SOURCE_BELOW=str(args.source_below),
            MESH_PLACEMENT_DESTINATION_ABOVE=str(args.destination_above),
        ) as mesh:
            points += asyncio.run(balance_points(args, balanced, mesh, model_path, work, log))
    (work / "balance.json").write_text(json.dumps(points, indent=1))
    lines = [
        f"{args.requests} requests per point, Poisson arrivals; {args.long_share:.0%} long "
        f"({args.long[0]}+{args.long[1]} tokens), the rest short ({args.short[0]}+{args.short[1]}); two decode "
        f"workers with {args.kv_blocks} KV blocks of {BLOCK_SIZE} tokens; balancing thresholds: source below "
        f"{args.source_below}, destination above {args.destination_above}. Median [min–max] over {args.reps} "
        "repetitions.",
        "",
        "| rate (req/s) | balancing | completed / failed | P99 TTFT ms | mean TTFT ms | P99 TPOT ms | "
        "mean TPOT ms | migrations | preemptions | P99 TPOT off/on |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in args.rates:
        p99_off = None
        for balanced in (False, True):
            runs = [p for p in points if p["rate"] == rate and p["balance"] == balanced]
            col = lambda key: [r[key] or 0.0 for r in runs]  # noqa: E731
            p99 = statistics.median(col("p99_tpot_ms"))
            ratio = f"{p99_off / p99:.2f}×" if balanced and p99 else "—"
            p99_off = p99
            lines.append(
                f"| {rate:g} | {'on' if balanced else 'off'} | {sum(col('completed')):.0f} / "
                f"{sum(col('failed')):.0f} | {spread(col('p99_ttft_ms'))} | {spread(col('mean_ttft_ms'))} | "
                f"{spread(col('p99_tpot_ms'), 1)} | {spread(col('mean_tpot_ms'), 1)} | "
                f"{spread(col('migrations'))} | {spread(col('preemptions'))} | {ratio} |"
            )
    return "\n".join(lines)


# ---- drain --------------------------------------------------------------------------------------------------------


async def stream(http: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int) -> list[int] | str:
    """A greedy streaming completion's token ids, or its error."""
    tokens: list[int] = []
    async with http.stream(
        "POST",
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        },
    ) as resp:
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"error: {chunk['error'].get('message')}"
            tokens += chunk["choices"][0].get("token_ids") or []
    return tokens


async def drain_once(args: argparse.Namespace, mode: str, rep: int, mesh: LaunchedMesh, work: Path) -> dict:
    victim = f"victim-{rep}-{mode}"
    worker = start_service("decode-worker", mesh.service_env(MESH_WORKER_ID=victim), work / f"{victim}.log")
    # Placement empties any draining worker it sees: only the `migrate` runs have one.
    placement = (
        start_service("placement", mesh.service_env(), work / f"placement-{rep}.log") if mode == "migrate" else None
    )
    bus = await Bus.connect(mesh.nats_url, "bench-drain")
    beats = await Heartbeats().watch(bus)
    try:
        await beats.until(lambda seen: victim in seen, 600, f"heartbeat of {victim}")
        while placement is not None:
            try:
                await placement_status(bus)
                break
            except MeshError:
                await asyncio.sleep(0.2)
        prompts = [prompt_ids(args.prompt, seed=1000 * rep + i) for i in range(args.requests)]
        async with httpx.AsyncClient(timeout=600, headers=mesh.headers) as http:
            streams = [asyncio.create_task(stream(http, mesh.url, args.model, ids, args.output)) for ids in prompts]
            await beats.until(
                lambda seen: sum(r.generated >= 16 for r in seen[victim].requests) >= 2,
                120,
                f"two requests running on {victim}",
            )
            held = len(beats.latest[victim].requests)
            commanded = time.perf_counter()
            if mode == "migrate":
                await bus.request(
                    Subjects.PLACEMENT, PlacementRequest(op="drain", worker_id=victim), PlacementStatus, timeout=30
                )
            else:
                await bus.request(Subjects.drain(victim), DrainCommand(exit=True), Ack, timeout=30)
            emptied = None
            while worker.alive():
                info = beats.latest[victim]
                if emptied is None and not info.requests and info.state == "draining":
                    emptied = time.perf_counter() - commanded
                await asyncio.sleep(0.02)
            exited = time.perf_counter() - commanded
            outputs = await asyncio.gather(*streams)
    finally:
        await bus.close()
        worker.stop()
        if placement is not None:
            placement.stop()
    lost = [
        o if isinstance(o, str) else f"{len(o)} tokens" for o in outputs if isinstance(o, str) or len(o) != args.output
    ]
    print(
        f"drain {mode} rep {rep}: {held} requests on {victim}; empty after {emptied or exited:.2f} s, exited after "
        f"{exited:.2f} s (code {worker.proc.returncode}); lost {len(lost)} {lost[:2]}",
        file=sys.stderr,
        flush=True,
    )
    return {
        "mode": mode,
        "rep": rep,
        "held": held,
        "empty_s": emptied or exited,
        "exit_s": exited,
        "exit_code": worker.proc.returncode,
        "lost": len(lost),
        "outputs": outputs,
    }


def drain(args: argparse.Namespace, work: Path, model_path: str) -> str:
    runs = []
    with launch_mesh(
        work / "drain",
        Path(model_path).parent,
        MESH_MODEL=args.model,
        MESH_REQUEST_TIMEOUT_S="600",
        MESH_PLACEMENT_BALANCE="0",
    ) as mesh:
        for process in psutil.Process(mesh.launcher.pid).children(recursive=True):
            if "llmesh_placement" in " ".join(process.cmdline()):
                process.terminate()  # the runs start their own, or none
        for rep in range(args.reps):
            for mode in ("migrate", "wait") if rep % 2 == 0 else ("wait", "migrate"):
                runs.append(asyncio.run(drain_once(args, mode, rep, mesh, work)))
    by_rep = {(r["rep"], r["mode"]): r["outputs"] for r in runs}
    for r in runs:
        other = by_rep[(r["rep"], "wait" if r["mode"] == "migrate" else "migrate")]
        r["equal"] = sum(a == b for a, b in zip(r.pop("outputs"), other))
    (work / "drain.json").write_text(json.dumps(runs, indent=1))
    lines = [
        f"{args.requests} streaming requests of {args.prompt}+{args.output} tokens per repetition, two decode "
        f"workers; median [min–max] over {args.reps} repetitions.",
        "",
        "| drain | requests on the worker | empty after s | exited after s | exit codes | lost | "
        "outputs equal the other mode's |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ("migrate", "wait"):
        rows = [r for r in runs if r["mode"] == mode]
        lines.append(
            f"| {mode} | {spread([r['held'] for r in rows])} | {spread([r['empty_s'] for r in rows], 2)} | "
            f"{spread([r['exit_s'] for r in rows], 2)} | {sorted({r['exit_code'] for r in rows})} | "
            f"{sum(r['lost'] for r in rows)} | {sum(r['equal'] for r in rows)} of "
            f"{args.requests * len(rows)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "llmesh")
    parser.add_argument("--reps", type=int, default=3)
    commands = parser.add_subparsers(dest="command", required=True)
    bal = commands.add_parser("balance", help="P99 TTFT/TPOT of a skewed workload, placement's balancing off and on")
    bal.add_argument("--rates", nargs="+", type=float, default=[1.5, 2.5])
    bal.add_argument("--requests", type=int, default=30)
    bal.add_argument("--long-share", type=float, default=0.25)
    bal.add_argument("--short", nargs=2, type=int, default=[256, 48], metavar=("PROMPT", "OUTPUT"))
    bal.add_argument("--long", nargs=2, type=int, default=[256, 1024], metavar=("PROMPT", "OUTPUT"))
    bal.add_argument("--kv-blocks", type=int, default=40)
    bal.add_argument("--source-below", type=float, default=3.0)
    bal.add_argument("--destination-above", type=float, default=8.0)
    dr = commands.add_parser("drain", help="time to empty a busy worker, and requests lost, migrating or waiting")
    dr.add_argument("--requests", type=int, default=8)
    dr.add_argument("--prompt", type=int, default=256)
    dr.add_argument("--output", type=int, default=600)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix=f"llmesh-bench-{args.command}-"))
    model_path = resolve_model(args.model, args.model_dir)
    table = (balance if args.command == "balance" else drain)(args, work, model_path)
    print(f"\n`bench/placement.py {' '.join(sys.argv[1:])}`; work in {work}\n\n{table}")


if __name__ == "__main__":
    main()
