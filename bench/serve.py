"""The mesh under load, beside what users would run instead, measured with vLLM's own client.

    .venv/bin/python bench/serve.py                # the full sweep (docs/serve/), under 30 minutes
    .venv/bin/python bench/serve.py --quick --out /tmp/serve   # a few requests per deployment

Deployments, all on this machine and model, started once and measured one at a time:
- `mesh`: the whole mesh as `make run` starts it (`python -m llmesh.deploy.launcher`);
- `mesh-aggregated` (only when `--deployments` names it; "mesh (aggregated)"): the same with the model served
  aggregated (`disaggregated: false`): one engine on both cores running each request whole, as plain vLLM's;
- `vllm`: one plain vLLM OpenAI server (vLLM's default CPU layout: one core computes, one is left);
- `vllm-router`: `vllm-router` (the vLLM project's Rust router, from PyPI) over two plain vLLM
  servers pinned to one core each, with the policy that suits the workload (`--router-policy`);
- `dynamo` (only when `--deployments` names it; labelled "dynamo (vLLM 0.31)"): NVIDIA Dynamo 1.6.1,
  two workers of its vLLM backend pinned to one core each as vllm-router's servers are, with the same
  engine settings, behind its frontend and KV-aware router (`--router-mode kv`, fed by the engines'
  KV events), no etcd or NATS (bench/dynamo_vllm.py). Its backend is built against vLLM 0.31, a
  version behind ours, so it runs from a venv of its own (tests/tool_envs.py `dynamo-vllm`, built on
  first use, a few minutes).

Workloads: `random` (vLLM's random dataset), `prefix` (vLLM's `prefix_repetition`: a few shared
prefixes) and `trace` (the Azure LLM inference conversation trace, bench/data, replayed with its
own arrival pattern through vLLM's `timed_trace` dataset, lengths scaled to this machine's model).
For each repetition, workload and rate every deployment gets the same requests, in an order that
rotates between repetitions. Each point records vLLM's metrics (TTFT, TPOT, ITL, throughput,
goodput against `--slo-ttft-ms`/`--slo-tpot-ms`) and the CPU seconds each process of the deployment
used. Writes results.json, serve.md (tables: medians over repetitions with their range) and
serve.png (P99 TTFT and goodput against rate) into `--out`, and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TextIO

import httpx
from harness import (  # bench/harness.py (this folder is on sys.path when a script runs)
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    cpu_between,
    cpu_by_process,
    is_engine,
    start_mesh,
)

from llmesh.deploy.launcher import Child, free_port
from llmesh.engine.models import cpu_dtype, resolve_model

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "bench" / "data" / "azure_conv_2023_first3000.csv"
DEPLOYMENTS = ("mesh", "vllm", "vllm-router")  # the default
OPTIONAL_DEPLOYMENTS = ("dynamo", "mesh-aggregated")  # on request (`--deployments ... dynamo`)
ALL_DEPLOYMENTS = DEPLOYMENTS + OPTIONAL_DEPLOYMENTS
LABELS = {
    "dynamo": "dynamo (vLLM 0.31)",
    "mesh-aggregated": "mesh (aggregated)",
}  # a peer on another vLLM version says so wherever it is shown
WORKLOADS = ("random", "prefix", "trace", "long")  # long (128 -> 512 tokens, decode-heavy): on request only
ROUTER_POLICY = {"random": "power_of_two", "prefix": "cache_aware", "trace": "power_of_two", "long": "power_of_two"}
# every deployment's vLLM engines but the mesh's (which take MESH_MAX_MODEL_LEN, MESH_BLOCK_SIZE), and `--dtype`
ENGINE_ARGS = [
    "--enforce-eager",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--block-size",
    str(BLOCK_SIZE),
]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache
IDLE_S = 2.0  # a vLLM engine busy-polls for about a second after its last step
TRACE_INPUT_SCALE, TRACE_OUTPUT_SCALE = 0.5, 0.25  # Azure conv: 1150 -> ~575 prompt tokens, 260 -> ~65 output
SUMMARY = (
    "completed",
    "failed",
    "duration",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


async def timed_completion(http: httpx.AsyncClient, url: str, body: dict) -> tuple[float | None, float | None, str]:
    """A streaming completion (`body` without `stream`): its TTFT and mean TPOT in seconds (None: no token came)
    and its error ("" if none: an HTTP status, the stream's error code, the client's exception)."""
    sent, first, tokens, error = time.monotonic(), None, 0, ""
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"].get("code") or "error"
                        break
                    if chunk["choices"][0].get("text") or chunk["choices"][0].get("finish_reason"):
                        first = first or time.monotonic()
                        tokens += 1
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    if first is None:
        return None, None, error or "no tokens"
    return first - sent, (time.monotonic() - first) / max(tokens - 1, 1), error


PROBE_PROMPT_TOKENS = (8, 512)


def probe_path(deployment: Deployment, model: str, n: int) -> list[dict]:
    """`n` lone requests of each of PROBE_PROMPT_TOKENS' lengths and one output token through `deployment`,
    each after IDLE_S: their TTFTs in ms, by length (what its request path adds to an idle engine's prompt
    step, with that step)."""

    async def go() -> dict[int, list[float]]:
        ttfts: dict[int, list[float]] = {tokens: [] for tokens in PROBE_PROMPT_TOKENS}
        async with httpx.AsyncClient(timeout=60, headers=deployment.headers) as http:
            for i in range(n):
                for tokens in PROBE_PROMPT_TOKENS:
                    await asyncio.sleep(IDLE_S)
                    body = {"model": model, "prompt": prompt_ids(tokens, 7000 + i), "max_tokens": 1, "temperature": 0}
                    ttft, _, error = await timed_completion(http, deployment.url, body)
                    if ttft is None:
                        raise RuntimeError(f"path probe of {deployment.name} failed: {error}")
                    ttfts[tokens].append(ttft * 1000)
        return ttfts

    probes = [{"deployment": deployment.name, "prompt_tokens": n, "ttft_ms": t} for n, t in asyncio.run(go()).items()]
    medians = ", ".join(f"{p['prompt_tokens']} tokens {statistics.median(p['ttft_ms']):.1f} ms" for p in probes)
    print(f"serve: {deployment.name}'s path: median TTFT {medians} ({n} probes each)", flush=True)
    return probes


def prompt_ids(length: int, seed: int) -> list[int]:
    """A prompt of `length` random token ids after BOS (the tiny models' vocabulary), the same for a seed."""
    import random

    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 2000) for _ in range(length - 1)]


# ---- deployments ------------------------------------------------------------------------------------------------


@dataclass
class Deployment:
    name: str
    url: str  # what clients call ("" until vllm-router is started)
    children: list[Child] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)  # vllm-router's servers
    headers: dict[str, str] = field(default_factory=dict)  # what its clients send (the mesh's API key)
    ready: Callable[[float], None] | None = None  # more to wait for once a completion succeeds (dynamo's workers)

    def roots(self) -> dict[str, int]:
        return {child.name: child.pid for child in self.children}


def vllm_server(name: str, model_path: str, served: str, logs: Path, dtype: str, **env: str) -> tuple[Child, str]:
    port = free_port()
    child = Child(
        name,
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_path,
            "--served-model-name",
            served,
            *ENGINE_ARGS,
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
        ],
        env={**ENGINE_ENV, **env},
        log_path=logs / f"{name}.log",
    )
    return child, f"http://127.0.0.1:{port}"


def start(name: str, model: str, model_path: str, work: Path, dtype: str) -> Deployment:
    """The deployment `name`, its engines' weights and KV in `dtype` (vLLM's)."""
    logs = work / "logs"
    if name in ("mesh", "mesh-aggregated"):
        env = {"MESH_MODEL": model, "MESH_DTYPE": dtype}
        if name == "mesh-aggregated":  # one engine on both cores running each request whole, as plain vLLM's
            env["MESH_MODELS"] = json.dumps([{"name": model, "model": model, "disaggregated": False}])
            env["MESH_PLACEMENT_AUTOSCALE"] = "false"  # (else the cores are split for the workers it may add)
        mesh = start_mesh(work / name, Path(model_path).parent, name, **env)
        return Deployment(name, mesh.url, [mesh.launcher], headers=mesh.headers)
    if name == "vllm":
        child, url = vllm_server("vllm", model_path, model, logs, dtype)
        return Deployment(name, url, [child])
    if name == "dynamo":  # workers dynamo-vllm-0 and -1 (engines on cores 0 and 1), dynamo-frontend
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from bench import dynamo_vllm

        children, url, ready = dynamo_vllm.start(
            model_path,
            model,
            work / "dynamo",
            [*ENGINE_ARGS, "--dtype", dtype],
            ENGINE_ENV,
            cores=(0, 1),
            router_mode="kv",
        )
        return Deployment(name, url, children, ready=ready)
    servers = [
        vllm_server(f"vllm-{core}", model_path, model, logs, dtype, VLLM_CPU_OMP_THREADS_BIND=str(core))
        for core in (0, 1)
    ]
    return Deployment(name, "", [child for child, _ in servers], [url for _, url in servers])  # router: per workload


def start_router(deployment: Deployment, backends: list[str], policy: str, logs: Path) -> None:
    """(Re)start vllm-router over `backends` with `policy`."""
    for child in [c for c in deployment.children if c.name == "vllm-router"]:
        child.stop()
        deployment.children.remove(child)
    port = free_port()
    binary = Path(sys.executable).parent / "vllm-router"
    deployment.children.append(
        Child(
            "vllm-router",
            [
                str(binary),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--policy",
                policy,
                "--worker-urls",
                *backends,
                "--log-level",
                "warning",
                "--prometheus-port",  # its default, 29000, may be taken (another router): it then panics
                str(free_port()),
            ],
            log_path=logs / f"vllm-router-{policy}.log",
        )
    )
    deployment.url = f"http://127.0.0.1:{port}"
    wait_ready(deployment, 60)


def wait_ready(
    deployment: Deployment, timeout: float, model: str | None = None, restarts: list[dict] | None = None
) -> None:
    """Until a completion succeeds (the mesh's /health, a router's /v1/models say less). With `restarts`, a
    child that dies while starting is started again once, and the death (its log's end) recorded there."""
    give_up = time.monotonic() + timeout
    while True:
        for child in deployment.children:
            if child.alive():
                continue
            death = {
                "process": child.name,
                "exit_code": child.proc.returncode,
                "log": str(child.log_path),
                "log_tail": child.log_tail(),
            }
            if restarts is None or any(r["process"] == child.name for r in restarts):
                raise RuntimeError(
                    f"{deployment.name}: {child.name} exited with {child.proc.returncode}; the end "
                    f"of {child.log_path}:\n{death['log_tail']}"
                )
            print(
                f"serve: {child.name} exited with {child.proc.returncode} while starting; starting it again "
                f"(why: {child.log_path})",
                flush=True,
            )
            restarts.append(death)
            child.restart()
            give_up = time.monotonic() + timeout
        try:
            resp = httpx.post(
                f"{deployment.url}/v1/completions",
                timeout=30,
                headers=deployment.headers,
                json={"model": model or "", "prompt": "warm up", "max_tokens": 4, "temperature": 0},
            )
            if resp.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > give_up:
            raise TimeoutError(f"{deployment.name} was not ready after {timeout:.0f}s")
        time.sleep(1)


# ---- workloads: vLLM's datasets and client ----------------------------------------------------------------------


def client_args(argv: list[str]) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


def trace_file(path: Path, requests: int, start: int, rate: float) -> Path:
    """`requests` consecutive requests of the Azure trace from `start`, its gaps stretched to `rate`
    on average, lengths scaled to the model, written as vLLM's timed_trace jsonl."""
    rows = list(csv.DictReader(open(TRACE)))
    rows = [rows[(start + i) % len(rows)] for i in range(requests)]
    stamps = [datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows]
    span = max(stamps[-1] - stamps[0], 1e-3)
    stretch = (requests - 1) / rate / span if requests > 1 else 0.0
    with open(path, "w") as f:
        for i, (row, stamp) in enumerate(zip(rows, stamps)):
            prompt = min(max(round(int(row["ContextTokens"]) * TRACE_INPUT_SCALE), 16), MAX_MODEL_LEN - 512)
            output = min(max(round(int(row["GeneratedTokens"]) * TRACE_OUTPUT_SCALE), 1), 256)
            hash_ids = [(start * 10_000 + i) * 1000 + j for j in range(math.ceil(prompt / 16))]  # unique: no sharing
            f.write(
                json.dumps(
                    {
                        "timestamp": (stamp - stamps[0]) * stretch,
                        "input_length": prompt,
                        "output_length": output,
                        "hash_ids": hash_ids,
                    }
                )
                + "\n"
            )
    return path


def workload_args(
    workload: str, requests: int, rate: float, point: int, model: str, model_path: str, work: Path
) -> argparse.Namespace:
    """vLLM client arguments of one point; `point` numbers the points of a workload, so that no two
    share prompts (every deployment would find the earlier point's in its prefix cache)."""
    common = [
        "--backend",
        "vllm",
        "--model",
        model_path,
        "--served-model-name",
        model,
        "--tokenizer",
        model_path,
        "--num-prompts",
        str(requests),
        "--seed",
        str(1000 + point),
        "--ignore-eos",
        "--temperature",
        "0",
        "--request-rate",
        str(rate),
    ]
    if workload in ("random", "long"):
        prompt, output = (512, 64) if workload == "random" else (128, 512)
        return client_args(
            common + ["--dataset-name", "random", "--random-input-len", str(prompt), "--random-output-len", str(output)]
        )
    if workload == "prefix":
        return client_args(
            common
            + [
                "--dataset-name",
                "prefix_repetition",
                "--prefix-repetition-prefix-len",
                "384",
                "--prefix-repetition-suffix-len",
                "128",
                "--prefix-repetition-num-prefixes",
                "4",
                "--prefix-repetition-output-len",
                "64",
            ]
        )
    path = trace_file(work / f"trace-{point}.jsonl", requests, start=point * 150, rate=rate)
    return client_args(common + ["--dataset-name", "timed_trace", "--dataset-path", str(path)])


def sample(args: argparse.Namespace, tokenizer) -> list:
    import random

    import numpy as np
    from vllm.benchmarks.datasets import get_samples

    random.seed(args.seed)
    np.random.seed(args.seed)
    return get_samples(args, tokenizer)


async def run_point(
    args: argparse.Namespace, requests: list, tokenizer, deployment: Deployment, slo: dict[str, float]
) -> dict:
    from vllm.benchmarks.serve import TaskType, benchmark

    return await benchmark(
        task_type=TaskType.GENERATION,
        endpoint_type="vllm",
        api_url=f"{deployment.url}/v1/completions",
        base_url=deployment.url,
        model_id=args.model,
        model_name=args.served_model_name,
        tokenizer=tokenizer,
        input_requests=requests,
        logprobs=None,
        request_rate=args.request_rate,
        burstiness=1.0,
        disable_tqdm=True,
        num_warmups=0,
        profile=False,
        selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
        selected_percentiles=[50, 99],
        ignore_eos=True,
        goodput_config_dict=slo,
        max_concurrency=None,
        lora_modules=None,
        extra_headers=deployment.headers or None,
        extra_body={"temperature": 0.0},
        ready_check_timeout_sec=0,
        self_timed=args.dataset_name == "timed_trace",
    )


# ---- results ----------------------------------------------------------------------------------------------------


def label(deployment: str) -> str:
    """A deployment's name in tables, plots and progress lines."""
    return LABELS.get(deployment, deployment)


def spread(values: list[float], digits: int = 0) -> str:
    """'median [min–max]' of repeated measurements."""
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def tables(points: list[dict], slo: dict[str, float]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for p in points:
        groups[(p["workload"], p["rate"], p["deployment"])].append(p)
    lines = [
        f"Goodput: requests with TTFT ≤ {slo['ttft']:.0f} ms and TPOT ≤ {slo['tpot']:.0f} ms, per second. "
        "Cells: median over repetitions [min–max]; CPU: CPU-seconds per 1k output tokens, services "
        "(everything but the engines' compute processes) + engines.",
        "",
        "| workload | req/s | deployment | ok / failed | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean | TPOT P50 "
        "| TPOT P99 | ITL mean | ITL P99 | out tok/s | goodput req/s | CPU services | CPU engines |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, rate, deployment), runs in sorted(
        groups.items(), key=lambda kv: (WORKLOADS.index(kv[0][0]), kv[0][1], ALL_DEPLOYMENTS.index(kv[0][2]))
    ):

        def col(key: str, runs: list = runs) -> list[float]:
            return [r[key] or 0.0 for r in runs]

        def per_k(engines: bool, runs: list = runs) -> list[float]:
            """CPU-seconds per 1k output tokens of the engines' processes or of the rest."""
            return [
                1000 * sum(v for k, v in r["cpu"].items() if is_engine(k) == engines) / max(r["total_output_tokens"], 1)
                for r in runs
            ]

        lines.append(
            f"| {workload} | {rate:g} | {label(deployment)} | {sum(col('completed')):.0f} / {sum(col('failed')):.0f} | "
            f"{spread(col('mean_ttft_ms'))} | {spread(col('median_ttft_ms'))} | {spread(col('p99_ttft_ms'))} | "
            f"{spread(col('mean_tpot_ms'), 1)} | {spread(col('median_tpot_ms'), 1)} | "
            f"{spread(col('p99_tpot_ms'), 1)} | "
            f"{spread(col('mean_itl_ms'), 1)} | {spread(col('p99_itl_ms'), 1)} | {spread(col('output_throughput'))} | "
            f"{spread(col('request_goodput'), 2)} | {spread(per_k(False), 2)} | {spread(per_k(True), 2)} |"
        )
    lines += [
        "",
        "CPU-seconds per 1k output tokens by process (all points of a workload together):",
        "",
        "| workload | deployment | process | CPU-s / 1k tokens |",
        "|---|---|---|---|",
    ]
    for workload in WORKLOADS:
        for deployment in ALL_DEPLOYMENTS:
            runs = [p for p in points if p["workload"] == workload and p["deployment"] == deployment]
            tokens = sum(r["total_output_tokens"] for r in runs)
            if not runs or not tokens:
                continue
            cpu: dict[str, float] = defaultdict(float)
            for r in runs:
                for process, seconds in r["cpu"].items():
                    cpu[process] += seconds
            for process, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
                if seconds / tokens * 1000 >= 0.005:
                    lines.append(f"| {workload} | {label(deployment)} | {process} | {seconds / tokens * 1000:.3f} |")
            client = sum(r["client_cpu"] for r in runs) / tokens * 1000
            lines.append(f"| {workload} | {label(deployment)} | (benchmark client) | {client:.3f} |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path, slo: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [w for w in WORKLOADS if any(p["workload"] == w for p in points)]
    fig, axes = plt.subplots(2, len(present), figsize=(5 * len(present), 8), squeeze=False)
    for col, workload in enumerate(present):
        for row, (key, title) in enumerate(
            (
                ("p99_ttft_ms", "P99 TTFT (ms)"),
                ("request_goodput", f"goodput (req/s, TTFT ≤ {slo['ttft']:.0f} ms, TPOT ≤ {slo['tpot']:.0f} ms)"),
            )
        ):
            ax = axes[row][col]
            for deployment in ALL_DEPLOYMENTS:
                by_rate: dict[float, list[float]] = defaultdict(list)
                for p in points:
                    if p["workload"] == workload and p["deployment"] == deployment:
                        by_rate[p["rate"]].append(p[key] or 0.0)
                if not by_rate:
                    continue
                rates = sorted(by_rate)
                med = [statistics.median(by_rate[r]) for r in rates]
                err = [
                    [m - min(by_rate[r]) for r, m in zip(rates, med)],
                    [max(by_rate[r]) - m for r, m in zip(rates, med)],
                ]
                ax.errorbar(rates, med, yerr=err, marker="o", capsize=3, label=label(deployment))
            ax.set_title(f"{workload}: {title}", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            if row == 0:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the run ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument(
        "--deployments",
        nargs="+",
        default=list(DEPLOYMENTS),
        choices=ALL_DEPLOYMENTS,
        help=f"default: {' '.join(DEPLOYMENTS)}; on request: "
        + ", ".join(f"{d} (shown as '{LABELS[d]}')" for d in OPTIONAL_DEPLOYMENTS),
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS[:3]), choices=WORKLOADS)
    parser.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=[0.5, 1, 2, 3],
        help="requests per second; the default spans a plain vLLM server's saturation (about 1.5 "
        "req/s on random 512->64) on a 2-core AVX2 machine: scale it to yours",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="arrivals per point span about this long")
    parser.add_argument("--min-requests", type=int, default=5)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument(
        "--router-policy",
        nargs="*",
        default=[],
        metavar="WORKLOAD=POLICY",
        help=f"vllm-router's policy per workload (default {ROUTER_POLICY})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one repetition of 4 requests per workload at 2 req/s, without warm-up (a smoke test)",
    )
    parser.add_argument(
        "--path-probes",
        type=int,
        default=0,
        help="before each workload's points, this many lone requests of each of a few lengths through each "
        "deployment, each after it went idle: its request path's cost (results.json's `path_probes`; "
        "`llmesh_sim.fidelity --path`)",
    )
    parser.add_argument(
        "--dtype",
        default=cpu_dtype(),
        choices=["bfloat16", "float32"],
        help="every deployment's engines'; default: bfloat16 where this CPU has it natively, float32 where it "
        "emulates it (AVX2 alone: ~1%% of float32's speed for a 1k-hidden model's GEMMs)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "serve")
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "llmesh")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.reps, args.min_requests, args.seconds = [2.0], 1, 4, 0.0
    policies = ROUTER_POLICY | dict(item.split("=", 1) for item in args.router_policy)
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="llmesh-serve-"))
    (work / "logs").mkdir()
    model_path = resolve_model(args.model, args.model_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops every process
    started = time.monotonic()
    deployments: dict[str, Deployment] = {}
    points: list[dict] = []
    restarts: list[dict] = []  # baseline servers that died starting, and why
    probes: list[dict] = []  # --path-probes
    stack = contextlib.ExitStack()
    try:
        for name in args.deployments:
            deployments[name] = start(name, args.model, model_path, work, args.dtype)
        print(f"serve: starting {', '.join(deployments)} (engines take a minute or two)...", flush=True)
        backends = [url for d in deployments.values() for url in d.backends]
        for deployment in deployments.values():  # a baseline's vLLM server that dies starting gets a second try
            baseline = restarts if not deployment.name.startswith("mesh") else None
            for child, url in zip(deployment.children, deployment.backends):  # vllm-router's servers
                wait_ready(Deployment(child.name, url, [child]), 600, args.model, baseline)
            if deployment.url:
                wait_ready(deployment, 600, args.model, baseline)
            if deployment.ready:
                deployment.ready(600)
        print(f"serve: all up after {time.monotonic() - started:.0f}s; work in {work}", flush=True)

        from vllm.tokenizers import get_tokenizer

        tokenizer = get_tokenizer(model_path)
        log = stack.enter_context(open(work / "logs" / "client.log", "w"))
        for rep in range(args.reps):
            for workload in args.workloads:
                if "vllm-router" in deployments:
                    start_router(deployments["vllm-router"], backends, policies[workload], work / "logs")
                    wait_ready(deployments["vllm-router"], 60, args.model)
                if rep == 0 and not args.quick:  # warm every deployment up on this workload's shapes (not recorded)
                    client = workload_args(workload, 4, 2.0, -1, args.model, model_path, work)
                    prompts = sample(client, tokenizer)
                    for deployment in deployments.values():
                        measure(deployment, client, prompts, tokenizer, slo, log)
                if rep == 0 and args.path_probes:
                    for deployment in deployments.values():
                        probes += [
                            p | {"workload": workload} for p in probe_path(deployment, args.model, args.path_probes)
                        ]
                for i, rate in enumerate(args.rates):
                    requests = max(args.min_requests, round(rate * args.seconds))
                    client = workload_args(
                        workload, requests, rate, rep * len(args.rates) + i, args.model, model_path, work
                    )
                    prompts = sample(client, tokenizer)
                    order = list(deployments)[rep % len(deployments) :] + list(deployments)[: rep % len(deployments)]
                    for name in order:
                        time.sleep(IDLE_S)
                        points.append(
                            measure(
                                deployments[name],
                                client,
                                prompts,
                                tokenizer,
                                slo,
                                log,
                                rep=rep,
                                workload=workload,
                                rate=rate,
                            )
                        )
                        p = points[-1]
                        print(
                            f"serve: rep {rep} {workload} {rate:g} req/s {label(name)}: {p['completed']} ok, "
                            f"{p['failed']} failed, TTFT mean {p['mean_ttft_ms']:.0f} P99 {p['p99_ttft_ms']:.0f} "
                            f"ms, TPOT {p['mean_tpot_ms']:.1f} ms, goodput {p['request_goodput']:.2f}/s "
                            f"[{time.monotonic() - started:.0f}s]",
                            flush=True,
                        )
    finally:
        stack.close()
        for deployment in deployments.values():
            for child in deployment.children:
                child.terminate()
        for deployment in deployments.values():
            for child in deployment.children:
                child.stop(30)
    command = "bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / "results.json").write_text(
        json.dumps(
            {"command": command, "slo": slo, "points": points, "restarts": restarts, "path_probes": probes}, indent=1
        )
    )
    (args.out / "serve.md").write_text(
        f"Command: `.venv/bin/python {command.strip()}`, "
        f"{datetime.now():%Y-%m-%d}, {time.monotonic() - started:.0f} s.\n\n"
        + "".join(
            f"{r['process']} exited with {r['exit_code']} while starting and "
            f"was started again (results.json has its log's end).\n\n"
            for r in restarts
        )
        + tables(points, slo)
    )
    plot(points, args.out / "serve.png", slo)
    print((args.out / "serve.md").read_text())
    failed = sum(p["failed"] for p in points)
    print(
        f"serve: {len(points)} points, {failed} failed requests, {time.monotonic() - started:.0f}s; "
        f"results in {args.out}",
        flush=True,
    )
    return 1 if failed else 0


def per_request(result: dict) -> dict[str, list]:
    """Each request's start (s after the point's first), prompt and output tokens, TTFT and TPOT
    (ms; None where it failed): what a point's summary hides, such as which prompts were slow."""
    starts = result.get("start_times") or []
    first = min(starts, default=0.0)
    ms = lambda v: round(v * 1000, 1) if v else None  # noqa: E731
    return {
        "start_s": [round(t - first, 3) for t in starts],
        "prompt_tokens": result.get("input_lens", []),
        "output_tokens": result.get("output_lens", []),
        "ttft_ms": [ms(t) for t in result.get("ttfts", [])],
        "tpot_ms": [ms(sum(itl) / len(itl)) if itl else None for itl in result.get("itls", [])],
    }


def measure(
    deployment: Deployment,
    client: argparse.Namespace,
    prompts: list,
    tokenizer,
    slo: dict[str, float],
    log: TextIO,
    **labels,
) -> dict:
    """One point on one deployment (vLLM's client prints its report into `log`)."""
    roots = deployment.roots()
    cpu_before, client_before = cpu_by_process(roots), time.process_time()
    with contextlib.redirect_stdout(log):
        result = asyncio.run(run_point(client, prompts, tokenizer, deployment, slo))
    cpu_after, client_cpu = cpu_by_process(roots), time.process_time() - client_before
    errors = sorted({e.strip().splitlines()[-1][:200] for e in result.get("errors", []) if e})
    return {
        "deployment": deployment.name,
        **labels,
        **{k: result.get(k) for k in SUMMARY},
        "errors": errors,
        "client_cpu": client_cpu,
        "requests": per_request(result),
        "cpu": cpu_between(cpu_before, cpu_after),
    }


if __name__ == "__main__":
    sys.exit(main())
