"""Several models on real engines: the mesh (placement activating models through a host agent) against what
users run instead, one plain vLLM server per model, statically partitioned over the same cores, behind
vllm-router in its multi-model mode (`--enable-igw`) (issue 33, parts 6 and the first goal).

    .venv/bin/python bench/models.py [--scales 0.02 0.04] [--duration 120] [--out DIR]

The workload (`llmesh_sim.multimodel`): three models; model 0 is the Azure 2023 conversation service and
model 1 its code service, each with its own arrivals and lengths, model 2 a later window of the
conversation service thinned to Zipf popularity (rank 3: a third of it kept); each point keeps a `--scale`
share of every arrival (the same ones for both deployments), prompts capped at `--max-prompt` tokens
(random ids), outputs at `--max-output` (ignore_eos, greedy). The three models are the embedded
tiny-llama, tiny-llama-b and tiny-llama-c (same shapes, other weights).

- static: one vLLM server per model, each with its own KV space (1 GiB), the conversation model pinned to
  core 0, the other two to core 1 (Algorithm 1 on the mean rates, as Prism's static baseline is placed);
  vllm-router over them routes by model.
- mesh: `make run`'s launcher with the three models in its catalogue and workers started for model 0
  only; the host agent's standbys (`--standbys` per role) become the others' workers when their first
  requests wait (placement's activation), on the same halves of the cores as every prefill and decode
  engine (`--aggregated`: a decode engine a model, running whole requests, on all the cores). The first
  point pays for those activations (static's servers were all started beforehand), unless `--warm` has
  each model answer one request before the load.
Per point: each model's SLO attainment (TTFT within `--ttft-slo-ms` and mean TPOT within `--tpot-slo-ms`),
the whole's, requests refused at the door (429) and lost (any other error, or no answer), TTFT P50/P99;
after the points, greedy outputs of a few prompts of each model, mesh against its vLLM server.
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
from harness import LaunchedMesh, cpu_between, cpu_by_process, is_engine, launch_mesh  # bench/harness.py
from serve import Deployment, prompt_ids, timed_completion, vllm_server, wait_ready  # bench/serve.py

from llmesh.deploy.launcher import Child, free_port, stop_all
from llmesh.engine.models import resolve_model
from llmesh_sim.__main__ import read_trace
from llmesh_sim.multimodel import multimodel_workload

MODELS = {"tiny-a": "llmesh/tiny-llama", "tiny-b": "llmesh/tiny-llama-b", "tiny-c": "llmesh/tiny-llama-c"}
CORES = {"tiny-a": "0", "tiny-b": "1", "tiny-c": "1"}  # static partitioning


def workload(duration_s: float, scale: float, max_prompt: int, max_output: int, seed: int):
    """(send at, model, prompt tokens, output tokens), in order: `scale` of the three models' arrivals (past 1:
    all of `duration_s * scale` seconds of them, that much faster)."""
    services = [read_trace("azure-conv"), read_trace("azure-code")]
    rng, names, faster = random.Random(seed), list(MODELS), max(scale, 1.0)
    return [
        (
            a.at_s / faster,
            names[int(a.model.rsplit("-", 1)[1])],
            min(a.prompt_tokens, max_prompt),
            max(1, min(a.output_tokens, max_output)),
        )
        for a in multimodel_workload(services, len(MODELS), duration_s * faster, popularity=1.0, seed=seed)
        if rng.random() < scale
    ]


async def one(http: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    ttft, tpot, error = await timed_completion(http, url, body)
    return {"model": model, "ttft": ttft, "tpot": tpot, "error": error}


async def replay(url: str, headers: dict, requests: list) -> list[dict]:
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=300, headers=headers, limits=httpx.Limits(max_connections=None)) as http:

        async def at(i: int, send_at: float, model: str, prompt: int, output: int) -> dict:
            await asyncio.sleep(max(send_at - (time.monotonic() - start), 0))
            return await one(http, url, model, prompt_ids(prompt, seed=i), output)

        return await asyncio.gather(*(at(i, *r) for i, r in enumerate(requests)))


def summary(results: list[dict], ttft_slo: float, tpot_slo: float) -> dict:
    ok = lambda r: not r["error"] and r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo  # noqa: E731
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None) or [float("nan")]
    out = {
        "requests": len(results),
        "refused": sum(r["error"] == "HTTP 429" for r in results),  # at the door, before any byte
        "lost": sum(bool(r["error"]) and r["error"] != "HTTP 429" for r in results),
        "errors": sorted({r["error"] for r in results if r["error"]}),
        "attainment": sum(map(ok, results)) / max(len(results), 1),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(int(0.99 * len(ttfts)), len(ttfts) - 1)],
    }
    for model in MODELS:
        mine = [r for r in results if r["model"] == model]
        out[f"attainment_{model}"] = sum(map(ok, mine)) / len(mine) if mine else None
    return out


def point(roots: dict[str, int], url: str, headers: dict, requests: list, slo: tuple[float, float]) -> dict:
    """One point's summary, with the CPU-seconds its deployment's processes took meanwhile, by process."""
    before = cpu_by_process(roots)
    out = summary(asyncio.run(replay(url, headers, requests)), *slo)
    cpu = {k: round(v, 1) for k, v in cpu_between(before, cpu_by_process(roots)).items() if v >= 0.05}
    out["cpu_s"] = dict(sorted(cpu.items(), key=lambda kv: -kv[1]))
    out["cpu_s_engines"] = round(sum(v for k, v in cpu.items() if is_engine(k)), 1)
    out["cpu_s_rest"] = round(sum(v for k, v in cpu.items() if not is_engine(k)), 1)
    return out


def greedy_texts(url: str, headers: dict) -> dict[str, list[str]]:
    out = {}
    with httpx.Client(timeout=120, headers=headers) as http:
        for model in MODELS:
            out[model] = []
            for n in (40, 300):
                body = {"model": model, "prompt": prompt_ids(n, seed=777 + n), "max_tokens": 16, "temperature": 0}
                resp = http.post(f"{url}/v1/completions", json=body)
                out[model].append(
                    resp.json()["choices"][0]["text"] if resp.status_code == 200 else f"HTTP {resp.status_code}"
                )
    return out


def warm_up(url: str, headers: dict) -> float:
    """One request to each model, all at once, answered: the seconds it took (the mesh: its activations)."""

    async def each() -> list[dict]:
        async with httpx.AsyncClient(timeout=600, headers=headers) as http:
            return await asyncio.gather(*(one(http, url, m, prompt_ids(32, seed=999), 8) for m in MODELS))

    start = time.monotonic()
    failed = [r for r in asyncio.run(each()) if r["error"]]
    assert not failed, failed
    return time.monotonic() - start


def static(work: Path, model_dir: Path) -> Deployment:
    """One vLLM server per model on its cores, and vllm-router in its multi-model mode over them: there it
    takes its workers from its API (`POST /workers`, which reads each one's model), not `--worker-urls`."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = [
        vllm_server(f"vllm-{name}", resolve_model(path, model_dir), name, logs, VLLM_CPU_OMP_THREADS_BIND=CORES[name])
        for name, path in MODELS.items()
    ]
    port = free_port()
    router = Child(
        "vllm-router",
        [
            str(Path(sys.executable).parent / "vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--enable-igw",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
        ],
        log_path=logs / "vllm-router.log",
    )
    deployment = Deployment("static", f"http://127.0.0.1:{port}", [*(c for c, _ in servers), router])
    for (child, url), name in zip(servers, MODELS):
        wait_ready(Deployment(name, url, [child]), 600, model=name)
        added = httpx.post(f"{deployment.url}/workers", json={"url": url}, timeout=30)
        assert added.status_code == 200 and added.json()["worker"]["model_id"] == name, added.text
    for name in MODELS:
        wait_ready(deployment, 60, model=name)
    return deployment


def mesh(
    work: Path, model_dir: Path, ttft_slo_ms: float, tpot_slo_ms: float, standbys: int, aggregated: bool
) -> LaunchedMesh:
    catalogue = [
        {"name": n, "model": p, "ttft_slo_ms": ttft_slo_ms, "tpot_slo_ms": tpot_slo_ms, "disaggregated": not aggregated}
        for n, p in MODELS.items()
    ]
    return launch_mesh(
        work,
        model_dir,
        600,
        MESH_MODELS=json.dumps(catalogue),
        MESH_STARTED_MODELS=next(iter(MODELS)),
        MESH_REQUEST_TIMEOUT_S="300",
        MESH_HOST_STANDBYS=str(standbys),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", type=float, nargs="+", default=[0.02, 0.04])
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--standbys", type=int, default=2, help="the host agent's standbys per role: the models it can activate at once"
    )
    parser.add_argument(
        "--aggregated",
        action="store_true",
        help="the mesh serves each model aggregated (decode workers running whole requests, one engine a model "
        "on all the cores) instead of a prefill and a decode engine a model on their halves",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="before the first point, one request to each model, so that the mesh's activations happen before the "
        "load as static's servers all start before it (without: the first point pays for them)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-models-"))
    model_dir = work / "models"
    points = {
        scale: workload(args.duration, scale, args.max_prompt, args.max_output, args.seed) for scale in args.scales
    }
    for scale, requests in points.items():
        by_model = {m: sum(r[1] == m for r in requests) for m in MODELS}
        print(
            f"scale {scale}: {len(requests)} requests over {args.duration:g} s {by_model}; work in {work}", flush=True
        )
    slo = (args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
    results: dict[str, dict] = {}
    texts: dict[str, dict] = {}
    deployment = static(work / "static", model_dir)
    try:
        for scale, requests in points.items():
            results[f"static@{scale}"] = point(deployment.roots(), deployment.url, {}, requests, slo)
            print(f"static@{scale}: {json.dumps(results[f'static@{scale}'])}", flush=True)
        texts["static"] = greedy_texts(deployment.url, {})
    finally:
        stop_all(deployment.children)
    launched = mesh(work / "mesh", model_dir, args.ttft_slo_ms, args.tpot_slo_ms, args.standbys, args.aggregated)
    url, headers = launched.url, launched.headers
    try:
        time.sleep(30)  # the host agent's standbys get ready
        if args.warm:
            print(f"mesh: every model answered in {warm_up(url, headers):.1f} s", flush=True)
            time.sleep(90)  # the workers activated join, and the host agent's new standbys get ready
        for scale, requests in points.items():
            results[f"mesh@{scale}"] = point({"mesh": launched.launcher.pid}, url, headers, requests, slo)
            print(f"mesh@{scale}: {json.dumps(results[f'mesh@{scale}'])}", flush=True)
        texts["mesh"] = greedy_texts(url, headers)
    finally:
        launched.launcher.stop(30)
    lines = [
        f"SLO: TTFT ≤ {args.ttft_slo_ms:g} ms and mean TPOT ≤ {args.tpot_slo_ms:g} ms",
        "",
        "| scale | deployment | requests | attainment | "
        + " | ".join(MODELS)
        + " | refused (429) | lost | TTFT P50 ms | TTFT P99 ms | CPU-s engines / rest |",
        "|---|---|---|---|" + "---|" * len(MODELS) + "---|---|---|---|---|",
    ]
    for scale in args.scales:
        for name in ("static", "mesh"):
            r = results[f"{name}@{scale}"]
            per = " | ".join(
                "-" if r[f"attainment_{m}"] is None else f"{100 * r[f'attainment_{m}']:.1f}%" for m in MODELS
            )
            lines.append(
                f"| {scale:g} | {name} | {r['requests']} | {100 * r['attainment']:.1f}% | {per} | "
                f"{r['refused']} | {r['lost']} | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['cpu_s_engines']:g} / {r['cpu_s_rest']:g} |"
            )
        s, m = results[f"static@{scale}"], results[f"mesh@{scale}"]
        lines.append(
            f"| {scale:g} | mesh / static | | {m['attainment'] / max(s['attainment'], 1e-9):.2f} | | | | | | | |"
        )
    equal = {model: texts["mesh"][model] == texts["static"][model] for model in MODELS}
    lines += ["", f"greedy outputs, mesh = its vLLM server: {equal}", "", "CPU-seconds by process, per point:"]
    lines += [f"- {name}: {json.dumps(r['cpu_s'])}" for name, r in results.items()]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "models.json").write_text(json.dumps({"results": results, "texts": texts}, indent=1))
        (args.out / "models.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
