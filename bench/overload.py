"""Past saturation, and for a long while: what the mesh does with more than it can serve, and whether it holds.

    .venv/bin/python bench/overload.py overload --rates 48 96        # the mesh beside plain vLLM
    .venv/bin/python bench/overload.py soak --rate 25 --minutes 10   # the mesh alone, at a steady rate

`overload`: vLLM's benchmark client sends random 512->64 requests at each rate for `--seconds` to
the mesh (as `make run` starts it) and to one plain vLLM server, one after the other. Per point:
requests completed, refused with 429 (the mesh's router refuses what its queue cannot start within
`MESH_QUEUE_MAX_WAIT_S` or the request's deadline), failed otherwise (timeouts, errors), TTFT of the
completed, goodput, and how long after the last arrival the deployment took to finish.

`soak`: the mesh at `--rate` for `--minutes`; every 10 s each service's resident memory and open
files (its whole process tree, engines included) are sampled, and their slopes after the first
minute are reported (MB and files per minute; the samples are kept in the run's folder), with every
request accounted for, every ERROR or Traceback line in the services' logs counted, and the mesh's
own WARNING lines counted by message. Prints markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import serve  # bench/serve.py (this folder is on sys.path when a script runs)

from llmesh.engine.models import resolve_model

SAMPLE_S = 10.0


def point(
    deployment: serve.Deployment,
    rate: float,
    seconds: float,
    seed: int,
    model: str,
    model_path: str,
    tokenizer,
    slo: dict[str, float],
    log,
) -> dict:
    requests = max(1, round(rate * seconds))
    client = serve.workload_args("random", requests, rate, seed, model, model_path, Path(tempfile.gettempdir()))
    prompts = serve.sample(client, tokenizer)
    started = time.monotonic()
    with contextlib.redirect_stdout(log):
        result = asyncio.run(serve.run_point(client, prompts, tokenizer, deployment, slo))
    errors = [e for e in result.get("errors", []) if e]
    refused = sum("Too Many Requests" in e for e in errors)
    ttfts = [t * 1000 for t in result.get("ttfts", []) if t]
    return {
        "deployment": deployment.name,
        "rate": rate,
        "sent": requests,
        "completed": result["completed"],
        "refused": refused,
        "failed": result["failed"] - refused,
        "ttft_p50": statistics.median(ttfts) if ttfts else None,
        "ttft_p99": sorted(ttfts)[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "goodput": result.get("request_goodput"),
        "done_after_s": time.monotonic() - started - seconds,
        "other_errors": sorted({e.strip().splitlines()[-1][:120] for e in errors if "Too Many" not in e}),
    }


def overload(args, model_path: str, tokenizer, work: Path, log) -> str:
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    rows = []
    with deployments(("mesh", "vllm"), args.model, model_path, work) as running:
        for rep in range(args.reps):
            for i, rate in enumerate(args.rates):
                for deployment in running.values():
                    time.sleep(serve.IDLE_S)
                    rows.append(
                        point(
                            deployment, rate, args.seconds, 100 * rep + i, args.model, model_path, tokenizer, slo, log
                        )
                    )
                    print(f"overload: {rows[-1]}", flush=True)
    lines = [
        "| req/s | deployment | sent | completed | refused (429) | failed otherwise | TTFT P50 (ms) | "
        "TTFT P99 (ms) | goodput req/s | done after the last arrival (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, d=0: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in sorted(rows, key=lambda r: (r["rate"], r["deployment"])):
        lines.append(
            f"| {r['rate']:g} | {r['deployment']} | {r['sent']} | {r['completed']} | {r['refused']} | "
            f"{r['failed']} | {fmt(r['ttft_p50'])} | {fmt(r['ttft_p99'])} | {fmt(r['goodput'], 2)} | "
            f"{fmt(r['done_after_s'], 1)} |"
        )
    others = sorted({e for r in rows for e in r["other_errors"]})
    return "\n".join(lines + ([f"\nOther errors: {others}"] if others else []))


def tree_usage(pid: int) -> tuple[float, int]:
    """Resident MB and open files of a process and its descendants."""
    rss, files = 0, 0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                rss += proc.memory_info().rss
                files += proc.num_fds()
    except psutil.Error:
        pass
    return rss / 2**20, files


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope per minute of (seconds, value) samples."""
    if len(samples) < 2:
        return 0.0
    xs, ys = [t / 60 for t, _ in samples], [v for _, v in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def soak(args, model_path: str, tokenizer, work: Path, log) -> str:
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    with deployments(("mesh",), args.model, model_path, work) as running:
        mesh = running["mesh"]
        services = {}
        for proc in psutil.Process(mesh.children[0].pid).children(recursive=True):
            argv = proc.cmdline()
            if argv[1:2] == ["-m"] and argv[2].startswith("llmesh_"):
                services[f"{argv[2]}-{proc.pid}"] = proc.pid
            elif proc.name() in ("nats-server", "redis-server"):
                services[proc.name()] = proc.pid
        samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in services}
        stop = threading.Event()
        begun = time.monotonic()

        def sample() -> None:
            while not stop.wait(SAMPLE_S):
                for name, pid in services.items():
                    mb, files = tree_usage(pid)
                    samples[name].append((time.monotonic() - begun, mb, files))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            result = point(mesh, args.rate, args.minutes * 60, 7, args.model, model_path, tokenizer, slo, log)
        finally:
            stop.set()
            sampler.join()
    log_text = "\n".join(p.read_text(errors="replace") for p in (work / "logs" / "mesh").glob("*.log"))
    error_lines = [line for line in log_text.splitlines() if re.search(r"\bERROR\b|Traceback", line)]
    # the mesh's own warnings (not vLLM's start-up notices), by message with request ids and numbers blanked
    warnings = collections.Counter(
        re.sub(r"cmpl-[\w/-]+|\d+", "N", line.split(" WARNING ", 1)[1])[:150]
        for line in log_text.splitlines()
        if " WARNING " in line and "llmesh" in line
    )
    (work / "samples.json").write_text(json.dumps(samples))
    lines = [
        f"{result['sent']} requests sent at {args.rate:g} req/s for {args.minutes:g} min: {result['completed']} "
        f"completed, {result['refused']} refused (429), {result['failed']} failed otherwise; TTFT P50 "
        f"{result['ttft_p50'] or 0:.0f} ms, P99 {result['ttft_p99'] or 0:.0f} ms; {len(error_lines)} ERROR or "
        "Traceback lines in the services' logs.",
        "",
        "| service | RSS first → last (MB) | RSS slope after 1 min (MB/min) | open files first → last | "
        "files slope (per min) |",
        "|---|---|---|---|---|",
    ]
    for name, rows in samples.items():
        steady = [(t, mb, f) for t, mb, f in rows if t >= 60] or rows
        if not rows:
            continue
        lines.append(
            f"| {name} | {rows[0][1]:.0f} → {rows[-1][1]:.0f} | {slope([(t, mb) for t, mb, _ in steady]):+.2f} "
            f"| {rows[0][2]} → {rows[-1][2]} | {slope([(t, f) for t, _, f in steady]):+.2f} |"
        )
    if error_lines:
        lines += ["", "First error lines:", *[f"    {line[:200]}" for line in error_lines[:10]]]
    if warnings:
        lines += [
            "",
            f"{sum(warnings.values())} WARNING lines of the mesh's own; the most frequent:",
            *[f"    {n} × {message}" for message, n in warnings.most_common(5)],
        ]
    lines.append(f"\nSamples (seconds, MB, open files per service): {work / 'samples.json'}")
    return "\n".join(lines)


@contextlib.contextmanager
def deployments(names, model: str, model_path: str, work: Path):
    running: dict[str, serve.Deployment] = {}
    try:
        for name in names:
            running[name] = serve.start(name, model, model_path, work)
        for deployment in running.values():
            serve.wait_ready(deployment, 600, model)
        yield running
    finally:
        for deployment in running.values():
            for child in deployment.children:
                child.stop(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["overload", "soak"])
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument("--rates", nargs="+", type=float, default=[48.0, 96.0], help="overload: requests per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="overload: arrivals per point span this long")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--rate",
        type=float,
        default=25.0,
        help="soak: requests per second (about 70%% of saturation on this machine's 2 cores)",
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "llmesh")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix=f"llmesh-{args.mode}-"))
    (work / "logs").mkdir()
    model_path = resolve_model(args.model, args.model_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_path)
    started = time.monotonic()
    with open(work / "logs" / "client.log", "w") as log:
        report = (overload if args.mode == "overload" else soak)(args, model_path, tokenizer, work, log)
    command = "bench/overload.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `.venv/bin/python {command}`, {time.monotonic() - started:.0f} s; logs in {work}\n\n{report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
