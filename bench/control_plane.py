"""The control plane at GPU speed: the mesh's router, NATS server and kv-store in front of modelled engines
(`llmesh_sim.modelled_engine`: the real worker services, their steps timed by a GPU profile, nothing computed),
at rising rates of streamed requests; beside it, in the same run, NVIDIA Dynamo's frontend over its mocker on the
same workload (`--peers dynamo`, bench/dynamo_peer.py), and vllm-router over the same modelled engines behind
OpenAI servers (`--peers vllm-router`, llmesh_sim.modelled_server).

    .venv/bin/python bench/control_plane.py --workers 4 16 --rates 25 50 100 --seconds 20 [--peers dynamo]
        [--py-spy DIR]  (py-spy on PATH: each point's front door sampled, where its time goes printed)
        [--routers 2 [--router-code CHECKOUT]]  (the mesh's requests alternate between two routers; the second
        runs another checkout's router code: old and new measured side by side, in the same conditions)
        [--routers 2 --cprofile DIR]  (the routers past the first under cProfile on their thread's CPU clock,
        bench/thread_profiled.py: each one's stats in DIR at the end, its top functions printed)

Each point is an open loop of Poisson arrivals of streamed completions (a prompt of `--prompt-tokens` words,
`--output-tokens` out, every request to its length). Per point: completed and failed, achieved request and
token rates, client TTFT, the added latency (client TTFT minus the modelled engine's own time from receiving the
request to its first token, matched by request id), and CPU seconds per request of each process of the
deployment (from /proc, over the point). The client runs on the same two cores as what it measures, for every
deployment alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_between, cpu_by_process, launch_mesh  # noqa: E402

from llmesh.deploy.launcher import Child, free_port, wait_healthy  # noqa: E402
from llmesh.engine.models import resolve_model  # noqa: E402

PROFILE = "h100-llama2-7b"
MODEL = "llmesh/tiny-llama"
REQUEST_ID = re.compile(r"(?:chat)?cmpl-[0-9a-f]{32}")
WORDS = "the of and to in is was for on that with as by at from his her an which or be are this".split()


@dataclass
class Outcome:
    door: int = 0  # which of the deployment's front doors it was sent to
    request_id: str = ""
    status: int = 0
    sent: float = 0.0
    ttft_s: float | None = None
    done_s: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class Point:
    deployment: str
    workers: int
    rate: float
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    engine_ttft_s: dict[str, float] = field(default_factory=dict)
    doors: list[str] = field(default_factory=list)  # the front doors' processes (cpu_s keys), where several

    def summary(self) -> dict:
        ok = [o for o in self.outcomes if o.status == 200 and o.done_s is not None]
        ttft = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
        added = sorted(
            o.ttft_s - self.engine_ttft_s[o.request_id]
            for o in ok
            if o.ttft_s is not None and o.request_id in self.engine_ttft_s
        )
        span = max((o.sent + o.done_s for o in ok), default=0.0) - min((o.sent for o in self.outcomes), default=0.0)
        tokens = sum(o.tokens for o in ok)
        n = max(len(ok), 1)
        return {
            "deployment": self.deployment,
            "workers": self.workers,
            "rate": self.rate,
            "sent": len(self.outcomes),
            "completed": len(ok),
            "failed": len(self.outcomes) - len(ok),
            "errors": sorted({o.error or str(o.status) for o in self.outcomes if o not in ok})[:5],
            "req_s": len(ok) / span if span else 0.0,
            "tokens_s": tokens / span if span else 0.0,
            "ttft_p50_ms": _pct(ttft, 50) * 1e3,
            "ttft_p99_ms": _pct(ttft, 99) * 1e3,
            "added_matched": len(added),
            "added_p50_ms": _pct(added, 50) * 1e3,
            "added_p99_ms": _pct(added, 99) * 1e3,
            "cpu_ms_per_request": {k: v * 1e3 / n for k, v in sorted(self.cpu_s.items(), key=lambda kv: -kv[1])},
            "cpu_us_per_token": {k: v * 1e6 / max(tokens, 1) for k, v in self.cpu_s.items()},
            # each front door's CPU over the requests it answered, where the requests alternate between several
            "door_cpu_ms_per_own_request": {
                door: self.cpu_s.get(door, 0.0) * 1e3 / max(sum(o.door == i for o in ok), 1)
                for i, door in enumerate(self.doors)
            },
        }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def prompt(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, out: Outcome) -> None:
    """A streamed completion: the time to its first token and to its end, its tokens (one SSE chunk a delta)."""
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = (await resp.text())[:200]
                return
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    out.done_s = time.monotonic() - out.sent
                    return
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - out.sent
                    found = REQUEST_ID.search(line.decode())
                    out.request_id = found.group(0) if found else ""
                out.tokens += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"


async def run_load(
    urls: list[str],
    headers: dict,
    model: str,
    rate: float,
    seconds: float,
    prompt_words: int,
    output_tokens: int,
    seed: int,
) -> list[Outcome]:
    """The point's requests, the i-th sent to `urls[i % len(urls)]`."""
    rng = random.Random(seed)
    bodies = [
        {
            "model": model,
            "prompt": prompt(prompt_words, rng),
            "max_tokens": output_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        for _ in range(int(rate * seconds))
    ]
    outcomes = [Outcome(door=i % len(urls)) for i in range(len(bodies))]
    # a connection a request: Dynamo's frontend holds a reused connection's first chunk for the client's delayed
    # ACK (~40 ms, bench/dynamo_peer.py), which says nothing of the CPU either spends
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        start = time.monotonic()
        due = start
        for body, out in zip(bodies, outcomes):
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            out.sent = time.monotonic()
            tasks.append(asyncio.create_task(one(session, urls[out.door], body, headers, out)))
        await asyncio.gather(*tasks)
    return outcomes


def engine_ttfts(folder: Path) -> dict[str, float]:
    """Each request's modelled engine time to its first token (the prefill's, or a whole request's)."""
    out: dict[str, float] = {}
    for path in folder.glob("*.tsv"):
        for line in path.read_text().splitlines():
            engine_id, seconds = line.split("\t")
            found = REQUEST_ID.search(engine_id)
            if found and not engine_id.startswith("decode-"):  # (a decode's first token is not the request's)
                out[found.group(0)] = float(seconds)
    return out


def measure(
    name: str,
    doors: dict[str, str],
    headers: dict,
    roots: dict[str, int],
    workers: int,
    args,
    timings: Path | None,
) -> list[dict]:
    """The deployment's points at each rate; `doors` its front doors' URLs by their processes' names (`cpu_s`'s
    keys), the requests alternating between them (where several, each door's CPU is also told over its own)."""
    urls = list(doors.values())
    several = list(doors) if len(doors) > 1 else []
    points = []
    for rate in args.rates:
        for path in timings.glob("*.tsv") if timings else ():
            path.write_text("")
        before = cpu_by_process(roots)
        collapsed = args.py_spy / f"{name}-{workers}w-{rate:g}rps.txt" if args.py_spy else None
        sampling = _sample_front_door(collapsed, roots, args.seconds) if collapsed else None
        outcomes = asyncio.run(
            run_load(
                urls, headers, args.model, rate, args.seconds, args.prompt_words, args.output_tokens, seed=int(rate)
            )
        )
        point = Point(name, workers, rate, args.seconds, outcomes, cpu_between(before, cpu_by_process(roots)))
        point.doors = several
        if sampling is not None:
            assert collapsed is not None
            sampling.wait()
            print(_where_time_goes(collapsed))
        if timings:
            time.sleep(1.5)  # the workers' files flushed (their buffers) at the next writes or shutdown
            point.engine_ttft_s = engine_ttfts(timings)
        s = point.summary()
        points.append(s)
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in list(s["cpu_ms_per_request"].items())[:6])
        print(
            f"{name} workers={workers} rate={rate}: {s['completed']}/{s['sent']} ok, {s['req_s']:.1f} req/s, "
            f"{s['tokens_s']:.0f} tok/s, TTFT p50 {s['ttft_p50_ms']:.1f} p99 {s['ttft_p99_ms']:.1f} ms, added p50 "
            f"{s['added_p50_ms']:.1f} p99 {s['added_p99_ms']:.1f} ms ({s['added_matched']} matched); CPU ms/request: "
            f"{cpu} {s['errors'] or ''}",
            flush=True,
        )
        if several:
            own = ", ".join(f"{k} {v:.2f}" for k, v in s["door_cpu_ms_per_own_request"].items())
            print(f"  each router's CPU ms over its own requests: {own}", flush=True)
    return points


ROOT = Path(__file__).resolve().parent.parent
PROJECT_DIRS = {"shared", "sim", *(p.name for p in (ROOT / "services").iterdir())}  # (as py-spy shortens paths)
# a process's and a thread's outermost frames, the event loop's run among them: in every sample of their thread
ROOT_FRAMES = ("_run_module_as_main ", "_run_code ", "<module> ", "run_service ", "Runner.run ", "Thread._bootstrap")
FRONT_DOORS = ("llmesh_router", "vllm-router", "dynamo.frontend")  # the process each deployment's samples are of


def _sample_front_door(collapsed: Path, roots: dict[str, int], seconds: float) -> subprocess.Popen:
    """py-spy sampling the deployment's front door over a point's load (`--py-spy`), its stacks collapsed into
    `collapsed`."""
    procs = [p for root in roots.values() for p in [psutil.Process(root), *psutil.Process(root).children(True)]]
    door = next(p for p in procs if any(name in " ".join(p.cmdline()) for name in FRONT_DOORS))
    collapsed.parent.mkdir(parents=True, exist_ok=True)
    command = ["py-spy", "record", "--pid", str(door.pid), "--duration", str(int(seconds)), "--rate", "250"]
    command += ["--format", "raw", "--function", "--nonblocking", "--output", str(collapsed)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _where_time_goes(collapsed: Path, top: int = 25) -> str:
    """The samples' shares by the function they were in, and by where that is: a project file, else the library
    (time in native code, the event loop's and the kernel's, counts to the Python frame that called it: uvloop's
    own under `Runner.run`, a socket write under uvicorn's `send`)."""
    own: Counter[str] = Counter()
    within: Counter[str] = Counter()  # samples in a function or in what it called
    where: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue  # (a frame's name that spans lines: a library's, as py-spy writes it)
        frames, n = stack.split(";"), int(count)
        leaf = frames[-1]
        total += n
        own[leaf] += n
        within.update(dict.fromkeys((f for f in frames if not f.startswith(ROOT_FRAMES)), n))
        file = leaf.rsplit("(", 1)[-1].split(":")[0]
        where[file if file.split("/", 1)[0] in PROJECT_DIRS else f"{file.split('/', 1)[0]} (library)"] += n
    rows = [f"{collapsed.name}: {total} samples", "  by function:"]
    rows += [f"    {n / total:6.1%}  {name}" for name, n in own.most_common(top)]
    rows += ["  within a function (its callees' included):"]
    rows += [f"    {n / total:6.1%}  {name}" for name, n in within.most_common(top)]
    rows += ["  by file or library:"] + [f"    {n / total:6.1%}  {name}" for name, n in where.most_common(top)]
    return "\n".join(rows)


def mesh_points(args, workers: int, work: Path) -> list[dict]:
    """The mesh as `make run` starts it, its decode workers modelled: each a process up to `--processes`, the
    rest together in one more (llmesh_sim.modelled_workers, with the environment the launcher gave the first)."""
    timings = work / "timings"
    catalogue = [{"name": args.model, "model": args.model, "disaggregated": False}]
    own = min(workers, args.processes)
    mesh = launch_mesh(
        work,
        Path.home() / ".cache" / "llmesh",
        timeout=600,
        MESH_MODELS=json.dumps(catalogue),
        MESH_MODELLED_ENGINE=args.profile,
        MESH_MODELLED_KV_BYTES_PER_TOKEN=str(args.kv_bytes_per_token),
        MESH_MODELLED_TIMINGS_DIR=str(timings),
        MESH_DECODE_WORKERS=str(own),
        MESH_CAPACITY=str(args.capacity),
        MESH_QUEUE_MAX_WAITING=str(100_000),
        MESH_LOG_LEVEL="WARNING",
    )
    rest = None
    routers: list[Child] = []
    try:
        roots = {"mesh": mesh.launcher.proc.pid}
        doors = {"mesh:router": mesh.url}
        for i in range(2, args.routers + 1):  # beside the launcher's, on the same NATS, Redis and workers
            port = free_port()
            env = mesh.service_env(MESH_PORT=str(port))
            if args.router_code is not None:  # another checkout's router package, shadowing this one's
                shadow = work / f"router-{i}-code"
                shadow.mkdir(parents=True)
                (shadow / "llmesh_router").symlink_to(args.router_code.resolve() / "services" / "router")
                env["PYTHONPATH"] = str(shadow)
            command = [sys.executable, "-m", "llmesh_router"]
            if args.cprofile is not None:
                args.cprofile.mkdir(parents=True, exist_ok=True)
                stats = args.cprofile / f"router-{i}-{workers}w.prof"
                command = [
                    sys.executable,
                    str(Path(__file__).parent / "thread_profiled.py"),
                    str(stats),
                    "llmesh_router",
                ]
            routers.append(Child(f"router-{i}", command, env=env, log_path=work / "logs" / f"router-{i}.log"))
            wait_healthy(f"http://127.0.0.1:{port}", 120, [*routers, mesh.launcher])
            if args.cprofile is not None:
                routers[-1].proc.send_signal(signal.SIGUSR1)  # start-up stays out of the profile
            roots[f"router-{i}"] = routers[-1].proc.pid
            doors[f"router-{i}"] = f"http://127.0.0.1:{port}"
        if workers > own:
            rest = Child(
                "modelled-workers",
                [
                    sys.executable,
                    "-m",
                    "llmesh_sim.modelled_workers",
                    "--role",
                    "decode",
                    "--count",
                    str(workers - own),
                ],
                env=mesh.service_env(),
                log_path=work / "logs" / "modelled-workers.log",
            )
            roots["mesh:modelled-workers"] = rest.proc.pid
            wait_for_workers(mesh.url, workers, [rest, mesh.launcher])
        return measure("mesh", doors, mesh.headers, roots, workers, args, timings)
    finally:
        for router in routers:
            router.stop(30)
        for stats in sorted(args.cprofile.glob(f"router-*-{workers}w.prof")) if args.cprofile else ():
            print(f"{stats.name}, by own CPU time:")
            pstats.Stats(str(stats)).sort_stats("tottime").print_stats(40)
        if rest is not None:
            rest.stop(60)
        mesh.launcher.stop(60)


def wait_for_workers(url: str, count: int, children: list[Child], timeout: float = 600) -> None:
    give_up = time.monotonic() + timeout
    while (live := httpx.get(f"{url}/health", timeout=5).json()["workers"].get("decode", 0)) < count:
        if time.monotonic() > give_up or not all(child.alive() for child in children):
            raise RuntimeError(f"{live} of {count} decode workers joined")
        time.sleep(1)


def dynamo_points(args, workers: int, work: Path) -> list[dict]:
    from dynamo_peer import dynamo  # noqa: PLC0415 (optional peer)

    model_dir = Path.home() / ".cache" / "llmesh" / args.model.split("/", 1)[1]
    with dynamo(model_dir, args.model, workers, work, prompt_tokens=args.prompt_words, log_level="warn") as d:
        roots = {"dynamo-frontend": d.frontend_pid, **{f"dynamo-mocker-{i}": p for i, p in enumerate(d.mocker_pids)}}
        return measure("dynamo", {"dynamo-frontend": d.url}, {}, roots, workers, args, None)


def vllm_router_points(args, workers: int, work: Path) -> list[dict]:
    """vllm-router (round robin) over `workers` modelled engines behind OpenAI servers (llmesh_sim.modelled_server)."""
    timings, logs = work / "timings", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model, Path.home() / ".cache" / "llmesh")
    servers, urls = [], []
    try:
        for i in range(workers):
            port = free_port()
            command = [sys.executable, "-m", "llmesh_sim.modelled_server", "--model", model_path, "--port", str(port)]
            command += ["--served-model-name", args.model, "--profile", args.profile, "--timings", str(timings)]
            command += ["--max-num-seqs", str(args.capacity)]
            servers.append(Child(f"modelled-server-{i}", command, log_path=logs / f"modelled-server-{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_healthy(url, 300, servers)
        port = free_port()
        command = [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
        command += ["--policy", "round_robin", "--worker-urls", *urls, "--log-level", "warning"]
        command += ["--prometheus-port", str(free_port())]
        router = Child("vllm-router", command, log_path=logs / "vllm-router.log")
        servers.append(router)
        wait_healthy(f"http://127.0.0.1:{port}", 60, servers)
        roots = {child.name: child.proc.pid for child in servers}
        return measure("vllm-router", {"vllm-router": f"http://127.0.0.1:{port}"}, {}, roots, workers, args, timings)
    finally:
        for child in servers:
            child.stop(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4])
    parser.add_argument("--rates", type=float, nargs="+", default=[25, 50, 100])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--prompt-words", type=int, default=512, help="prompt length in words (~1 token each)")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--profile", default=PROFILE)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--capacity", type=int, default=256, help="requests a worker takes at once")
    parser.add_argument(
        "--processes", type=int, default=8, help="the mesh's workers that run a process each (the rest share one)"
    )
    parser.add_argument("--kv-bytes-per-token", type=int, default=0, help="KV through the store (0: none)")
    parser.add_argument("--peers", nargs="*", default=[], choices=["dynamo", "vllm-router"])
    parser.add_argument("--routers", type=int, default=1, help="the mesh's routers, its requests alternating")
    parser.add_argument(
        "--router-code", type=Path, help="a checkout whose router code the routers past the first run (an A/B)"
    )
    parser.add_argument(
        "--cprofile", type=Path, help="profile the routers past the first (cProfile, thread CPU clock) into here"
    )
    parser.add_argument("--out", type=Path, help="write every point as JSON here")
    parser.add_argument("--py-spy", type=Path, help="sample each point's front door with py-spy (on PATH) into here")
    args = parser.parse_args(argv)
    points = []
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        for workers in args.workers:
            points += mesh_points(args, workers, Path(tmp) / f"mesh-{workers}")
            if "dynamo" in args.peers:
                points += dynamo_points(args, workers, Path(tmp) / f"dynamo-{workers}")
            if "vllm-router" in args.peers:
                points += vllm_router_points(args, workers, Path(tmp) / f"vllm-router-{workers}")
    for line in door_ratios(points):
        print(line)
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "points": points}, indent=1))
    return 0


FRONT_DOORS = {"mesh": "mesh:router", "dynamo": "dynamo-frontend", "vllm-router": "vllm-router"}


def door_ratios(points: list[dict]) -> list[str]:
    """Each point's front door's CPU a request (the mesh's routers' together, where several), the mesh's beside
    each peer's of the same workers and rate: the ratio the router's goal is stated in."""
    by_point: dict[tuple, dict[str, float]] = {}
    for p in points:
        door, cpu = FRONT_DOORS[p["deployment"]], p["cpu_ms_per_request"]
        doors = p["door_cpu_ms_per_own_request"] or {door: 0.0}  # (several routers: together, a request)
        by_point.setdefault((p["workers"], p["rate"]), {})[door] = sum(cpu.get(d, 0.0) for d in doors)
    lines = []
    for (workers, rate), at_point in by_point.items():
        mesh = at_point.get(FRONT_DOORS["mesh"])
        shown = [f"{door} {ms:.2f}" for door, ms in at_point.items()]
        ratios = [
            f"{mesh / ms:.2f}x {door}'s" for door, ms in at_point.items() if mesh and ms and door != FRONT_DOORS["mesh"]
        ]
        lines.append(
            f"front door CPU ms a request, workers={workers} rate={rate:g}: {', '.join(shown)}"
            + (f" (the mesh's router {', '.join(ratios)})" if ratios else "")
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
