"""Live-migration downtime against a recompute-based migration, in one run.

    .venv/bin/python bench/migration.py [--models llmesh/tiny-llama llmesh/small-llama]
                                        [--contexts 256 1024 2048 4096] [--repeats 3]

For each model: starts the mesh (the `make run` launcher) and a second decode worker, then streams
greedy requests through the router and, after a few tokens, migrates each one between the decode
workers, alternating the mechanisms: `kv` (the mesh's: the target prefetches the stored blocks while
the source decodes on; at the switch it loads what was generated since and computes one token) and
`recompute` (the target computes the whole context again, as a migration without a KV store must).
Downtime is what the client sees: the gap between the source's last token and the target's first
(the longest gap after the hand-shake was accepted), also in decode steps (over the stream's time per
output token, end to end but for that gap). The hand-shake (prefetch included) runs while the source
keeps streaming; the longest gap the client saw meanwhile is reported beside it. Each stream is
hung up a few tokens after the switch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from harness import launch_mesh  # bench/harness.py and bench/serve.py (this folder is on sys.path when a script runs)
from serve import prompt_ids

from llmesh.deploy.launcher import start_service
from llmesh.engine.models import resolve_model
from llmesh.wire.bus import Bus
from llmesh.wire.messages import MigrateCommand, MigrateOutcome, Subjects, WorkerInfo

OUTPUT_TOKENS = 3500  # long enough to outlive the hand-shake (the target prefetches meanwhile) on a fast machine
SWITCH_AT = 8  # the chunk after which the migration is commanded
AFTER_SWITCH = 20  # chunks read after the hand-over before hanging up


class EndedFirst(RuntimeError):
    """No worker took the migration: the request had ended (a reader starved of CPU got to the
    command's chunk too late); the run is repeated with another prompt."""


async def decode_workers(bus: Bus, count: int, timeout: float = 600) -> list[str]:
    seen: set[str] = set()

    async def on_heartbeat(info: WorkerInfo, blob) -> None:
        if info.role == "decode":
            seen.add(info.worker_id)

    await bus.serve(Subjects.HEARTBEAT, on_heartbeat, traced=False)
    give_up = time.monotonic() + timeout
    while len(seen) < count:
        assert time.monotonic() < give_up, f"{len(seen)} of {count} decode workers up"
        await asyncio.sleep(0.5)
    return sorted(seen)


async def one_run(
    http: httpx.AsyncClient, bus: Bus, url: str, model: str, workers: list[str], ids: list[int], recompute: bool
) -> dict[str, float]:
    stamps: list[float] = []
    tokens: list[int] = []  # in each chunk (deltas merge while the reader lags)
    accepted_at = handshake_s = sent_at = 0.0
    commanding: asyncio.Task | None = None

    async def migrate(request_id: str) -> None:
        nonlocal accepted_at, handshake_s
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            for source in workers:
                target = next(w for w in workers if w != source)
                sent = time.perf_counter()
                outcome, _ = await bus.request(
                    Subjects.migrate(source),
                    MigrateCommand(
                        migration_id=uuid.uuid4().hex,
                        request_id=request_id,
                        target=target,
                        reason="bench",
                        recompute=recompute,
                    ),
                    MigrateOutcome,
                    timeout=30,
                )
                if outcome.accepted:
                    accepted_at, handshake_s = time.perf_counter(), time.perf_counter() - sent
                    return
            await asyncio.sleep(0.005)
        raise EndedFirst(f"no worker accepted migrating {request_id}")

    async with http.stream(
        "POST",
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": ids,
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        },
    ) as resp:
        resp.raise_for_status()
        request_id = resp.headers["x-request-id"]
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, line
                stamps.append(time.perf_counter())
                tokens.append(len(event["choices"][0]["token_ids"]))
                if len(stamps) == SWITCH_AT:  # from a task: the reader's own stamps must not wait on it
                    sent_at = time.perf_counter()
                    commanding = asyncio.create_task(migrate(request_id))
                if accepted_at and sum(s > accepted_at for s in stamps) > AFTER_SWITCH:
                    break  # (the router aborts the rest)
    await commanding
    assert len(stamps) > SWITCH_AT + 1, f"{len(stamps)} chunks"  # (a lagging reader gets merged deltas)
    # the switch follows the acceptance (the source stops as it answers); the hand-shake precedes it
    downtime = max(b - a for a, b in zip(stamps, stamps[1:]) if b > accepted_at)
    during = [b - a for a, b in zip(stamps, stamps[1:]) if sent_at < b <= accepted_at]
    # time per token over the whole stream but the switch (end to end: robust to deltas merged while the reader lags)
    step = (stamps[-1] - stamps[1] - downtime) / max(sum(tokens[2:]) - 1, 1)
    return {
        "downtime_ms": 1e3 * downtime,
        "steps": downtime / step,
        "tpot_ms": 1e3 * step,
        "handshake_ms": 1e3 * handshake_s,
        "handshake_gap_ms": 1e3 * max(during, default=0.0),
    }


async def measured(
    http: httpx.AsyncClient,
    bus: Bus,
    url: str,
    model: str,
    workers: list[str],
    prompt_len: int,
    seed: int,
    recompute: bool,
) -> dict[str, float]:
    """`one_run` on a random prompt, again on another if the request ended before its command."""
    for attempt in range(3):
        try:
            return await one_run(
                http, bus, url, model, workers, prompt_ids(prompt_len, seed=seed + 1000 * attempt), recompute
            )
        except EndedFirst as exc:
            print(f"{exc}: again with another prompt", file=sys.stderr, flush=True)
    raise EndedFirst(f"three requests ended before their migration command ({prompt_len} tokens)")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


async def bench_model(model: str, contexts: list[int], repeats: int, work: Path) -> list[dict]:
    model_dir = Path.home() / ".cache" / "llmesh"
    resolve_model(model, model_dir)
    rows = []
    with launch_mesh(
        work,
        model_dir,
        600,
        MESH_MODEL=model,
        MESH_MAX_MODEL_LEN=str(max(contexts) + OUTPUT_TOKENS + 256),
        MESH_REQUEST_TIMEOUT_S="300",
        MESH_PLACEMENT_BALANCE="0",  # only this script migrates
    ) as mesh:
        # on the prefill engine's core (idle once the prompt is in): source and target one core each
        second = start_service(
            "decode-worker",
            mesh.service_env(MESH_WORKER_ID="decode-bench", MESH_CPU_CORES="0"),
            work / "decode-bench.log",
        )
        try:
            bus = await Bus.connect(mesh.nats_url, "bench-migration")
            workers = await decode_workers(bus, 2)
            url = mesh.url
            async with httpx.AsyncClient(timeout=300, headers=mesh.headers) as http:
                await measured(http, bus, url, model, workers, 300, 1, False)  # warm both paths
                await measured(http, bus, url, model, workers, 300, 2, True)
                for context in contexts:
                    runs: dict[str, list[dict]] = {"kv": [], "recompute": []}
                    for rep in range(repeats):
                        for mode in ("kv", "recompute"):
                            runs[mode].append(
                                await measured(
                                    http,
                                    bus,
                                    url,
                                    model,
                                    workers,
                                    context - SWITCH_AT,
                                    10_000 * context + 2 * rep + (mode == "kv"),
                                    mode == "recompute",
                                )
                            )
                    for mode, results in runs.items():
                        row = {
                            "model": model,
                            "context": context,
                            "mode": mode,
                            **{k: [r[k] for r in results] for k in results[0]},
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            await bus.close()
        finally:
            second.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["llmesh/tiny-llama", "llmesh/small-llama"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-bench-migration-"))
    rows = []
    for model in args.models:
        rows += asyncio.run(bench_model(model, args.contexts, args.repeats, work / model.replace("/", "_")))
    print(f"\nmedian (min–max) of {args.repeats} migrations each; logs in {work}\n")
    print(
        "| model | context | migration | downtime ms | downtime in decode steps | TPOT ms | hand-shake ms "
        "| longest gap in the hand-shake ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['context']} | {r['mode']} | {spread(r['downtime_ms'])} | {spread(r['steps'])} | "
            f"{spread(r['tpot_ms'])} | {spread(r['handshake_ms'])} | {spread(r['handshake_gap_ms'])} |"
        )
    kv = {(r["model"], r["context"]): statistics.median(r["downtime_ms"]) for r in rows if r["mode"] == "kv"}
    rc = {(r["model"], r["context"]): statistics.median(r["downtime_ms"]) for r in rows if r["mode"] == "recompute"}
    print("\n| model | context | recompute / kv downtime |\n|---|---|---|")
    for key in kv:
        print(f"| {key[0]} | {key[1]} | {rc[key] / kv[key]:.1f}× |")


if __name__ == "__main__":
    main()
