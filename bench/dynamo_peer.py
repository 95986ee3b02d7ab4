"""NVIDIA Dynamo 1.6.1's own HTTP frontend over its mocker (a simulated engine, no GPU): a benchmark peer.

    with dynamo(Path("/tmp/dyn-model"), "tiny", workers=4, work=Path("/tmp/dyn-work")) as peer:
        ...  # OpenAI API at peer.url; peer.frontend_pid and peer.mocker_pids for /proc/PID/stat CPU accounting

Dynamo runs from its own venv (`python tests/tool_envs.py dynamo` builds it once), with no etcd and no
NATS: discovery through files (a fresh DYN_FILE_KV folder under `work`), requests over TCP, events over
ZMQ, everything advertised on 127.0.0.1 (though its ZMQ publishers bind 0.0.0.0). HOME, XDG_CACHE_HOME
and HF_HOME point under `work` (the frontend writes a cache to ~/.cache/dynamo), HF_HUB_OFFLINE=1.
Logs: work/logs/{mocker,frontend}.log.

The workers are one mocker process (`--num-workers N`): that is how Dynamo simulates many workers
(each gets its own DistributedRuntime, so each registers as its own instance, and the frontend routes
among N instances as among N processes), sharing one tokio runtime, which keeps N=16 workers from
taking more threads than a small machine has cores.

The mocker's timing (dynamo_mocker's `PerfModel`, vLLM-like scheduler; checked by measurement, see
docs/benchmarks/control-plane.md): a forward pass lasts
    prefill_ms(T) + decode_ms(K, C)
with T the prompt tokens the pass computes (all its requests' new tokens together, cached prefix
excluded), K the sum of the context lengths (prompt + generated) of the requests decoding in it and
C their mean; a term is 0 when the pass has no such work, decode_ms is at least 1 ms. A prompt's
first token comes at the end of the pass that computes its last chunk (that pass does not also decode
it). With `--planner-profile-data FILE.npz`, prefill_ms is a 1-D linear interpolation over T and
decode_ms a bilinear one over (K, C), both extrapolated linearly. Without one it uses fixed
polynomials (prefill 16.5 ms + 15.2 us/token + 0.42 ns/token^2 of T; decode 5.74 to 34 ms by the
fraction of KV capacity in use), not our profile, so `write_perf_npz` turns our engine profile
(sim/profiles/h100-llama2-7b.json, `step_s = base_s + prefill_token_s * prompt tokens +
prefill_attention_s * prompt attention pairs + decode_seq_s * decoding requests + context_token_s *
their context`) into those tables:
    decode_ms(K, C)  = base_s + decode_seq_s * K / C + context_token_s * K      (exact: K / C is the batch)
    prefill_ms(T)    = prefill_token_s * T + prefill_attention_s * pairs(T)
where pairs(T) takes the pass's prompt tokens as whole prompts of `prompt_tokens` (the workload's
length) computed from scratch, the last one partial. What the tables cannot say: the prefill's
attention pairs of a batch of prompts of other lengths, or of a chunk after a cached prefix (c*k); and
base_s is charged once per pass only when the pass decodes something, so a pass that only computes
prompts (a lone request's first pass, on an idle engine) is base_s (5.985 ms) shorter than ours
(charging it in prefill_ms as well would make every mixed pass 5.985 ms longer, the case that sets
capacity). Engine limits as the profile's: block size, KV blocks, max_num_seqs,
max_num_batched_tokens; prefix caching and chunked prefill on (vLLM V1's defaults). Measured lone
requests (fresh connection): decode gaps within 0.2 % of the formula (6.11 ms at 512 + 64 tokens);
TTFT = prefill_ms + ~1.5-2 ms of frontend and transport (9.1-10.1 ms for 512 tokens; ours 13.2 ms).

Ready means: the model listed at /v1/models, `workers` generate instances in the discovery folder and,
with round-robin, as many one-token requests met `workers` distinct workers (the frontend's per-worker
metrics). The frontend does not set TCP_NODELAY: on a reused keep-alive connection the first chunk
after the response headers waits for the client's delayed ACK (~40 ms more TTFT); on a fresh
connection (what this script's rounds use) or with a client that quick-ACKs, it does not.

`python bench/dynamo_peer.py --model-dir DIR --workers N` starts it, sends `--requests` (20) concurrent
streamed /v1/completions of `--prompt-tokens` (512) random token ids and max_tokens `--max-tokens`
(128) with ignore_eos, `--rounds` times, and prints per round the frontend's (and the mocker's) CPU
seconds per request and per token from /proc/PID/stat utime+stime, the mean TTFT and inter-token
latency, as JSON lines (each round a new client: fresh connections). The mocker never ends a stream
early (it emits exactly max_tokens, with or without ignore_eos); the script checks every request got
exactly max_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import struct
import sys
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # (run as a script, only bench/ is on sys.path)
    sys.path.insert(0, str(ROOT))

from llmesh.deploy.launcher import Child, free_port, stop_all  # noqa: E402
from llmesh_sim.modelled_engine import load_profile, profile_path  # noqa: E402
from tests.tool_envs import dynamo_python  # noqa: E402

DEFAULT_PROFILE = "h100-llama2-7b"  # sim/profiles/
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _npy(values: Sequence[float], shape: tuple[int, ...]) -> bytes:
    """`values` (row-major) as a .npy file of little-endian float64 (format 1.0)."""
    dims = f"({shape[0]},)" if len(shape) == 1 else "(" + ", ".join(map(str, shape)) + ")"
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': " + dims + ", }"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"  # data 64-byte aligned, as numpy writes it
    return (
        b"\x93NUMPY\x01\x00"
        + struct.pack("<H", len(header))
        + header.encode()
        + struct.pack(f"<{len(values)}d", *values)
    )


def _pairs(tokens: int, prompt_tokens: int) -> int:
    """Attention pairs of `tokens` prompt tokens taken as whole prompts of `prompt_tokens`, the last partial."""
    whole, rest = divmod(tokens, prompt_tokens)
    return whole * prompt_tokens * (prompt_tokens + 1) // 2 + rest * (rest + 1) // 2


def perf_tables(profile: Any, prompt_tokens: int = 512) -> dict[str, tuple[list[float], tuple[int, ...]]]:
    """The mocker's timing tables (ms) for an engine profile (sim.engine.EngineProfile)."""
    p = profile
    step = 8
    isl = list(range(0, p.max_batched_tokens + step, step))
    prefill = [1e3 * (p.prefill_token_s * t + p.prefill_attention_s * _pairs(t, prompt_tokens)) for t in isl]
    # decode_ms is linear in K at a given C: two K points are exact (and so is the extrapolation); C on a
    # geometric grid (ratio ~1.047) keeps the linear interpolation of K / C within 0.06 % of it
    kv = [0.0, float(p.kv_blocks * p.block_size)]
    ctx = sorted({round(2 ** (17 * i / 255), 6) for i in range(256)})  # 1 .. 131072 tokens
    itl = [1e3 * (p.base_s + p.decode_seq_s * k / c + p.context_token_s * k) for k in kv for c in ctx]
    return {
        "prefill_isl": ([float(t) for t in isl], (len(isl),)),
        "prefill_ttft_ms": (prefill, (len(isl),)),
        "decode_active_kv_tokens": (kv, (len(kv),)),
        "decode_context_length": (ctx, (len(ctx),)),
        "decode_itl": (itl, (len(kv), len(ctx))),
    }


def write_perf_npz(path: Path, profile: Any, prompt_tokens: int = 512) -> Path:
    """The mocker-format .npz (`--planner-profile-data`) of `perf_tables`, written as numpy.savez would."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, (values, shape) in perf_tables(profile, prompt_tokens).items():
            z.writestr(name + ".npy", _npy(values, shape))
    return path


def cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads, live and exited), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class DynamoPeer:
    url: str  # http://127.0.0.1:PORT, the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions)
    served_name: str
    workers: int
    frontend_pid: int
    mocker_pids: list[int]  # one process holds all the workers
    logs: Path
    perf_npz: Path
    children: list[Child] = field(default_factory=list, repr=False)

    def frontend_cpu_s(self) -> float:
        return cpu_s(self.frontend_pid)

    def mocker_cpu_s(self) -> float:
        return sum(cpu_s(pid) for pid in self.mocker_pids)


def dynamo_env(work: Path, log_level: str | None = None) -> dict[str, str]:
    """The environment of every Dynamo process of a deployment under `work`: no etcd and no NATS (discovery in
    files under `work/discovery`, requests over TCP, events over ZMQ), everything advertised on 127.0.0.1, its
    home and caches under `work/home` (the frontend writes a cache to ~/.cache/dynamo), and `DYN_LOG`."""
    home = work / "home"
    env = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(work / "discovery"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1",  # else workers advertise the machine's external address
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "HF_HOME": str(home / ".cache" / "huggingface"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return env | ({"DYN_LOG": log_level} if log_level else {})


def frontend_command(python: Path, port: int, router_mode: str) -> list[str]:
    """Dynamo's OpenAI frontend (HTTP server, tokenizer, router) on 127.0.0.1:`port`."""
    return [str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port)] + [
        "--router-mode",
        router_mode,
    ]


def registered_workers(discovery: Path) -> int:
    """Workers whose generate endpoint is in the discovery folder."""
    instances = discovery / "v1" / "instances"
    return sum(1 for p in instances.glob("*") if "%2Fgenerate%2F" in p.name) if instances.is_dir() else 0


def served_workers(metrics: str) -> set[str]:
    """Workers the frontend has routed a request to, from its /metrics text (its per-worker series)."""
    return {
        line.split('worker_id="', 1)[1].split('"', 1)[0]
        for line in metrics.splitlines()
        if line.startswith("dynamo_frontend_worker_last_time_to_first_token_seconds{")
    }


@contextlib.contextmanager
def dynamo(
    model_dir: Path,
    served_name: str,
    workers: int,
    work: Path,
    *,
    router_mode: str = "round-robin",
    port: int | None = None,
    profile: Any = None,  # an engine profile (sim.engine.EngineProfile); None: DEFAULT_PROFILE
    prompt_tokens: int = 512,  # the workload's prompt length, for the prefill table's attention pairs
    log_level: str | None = None,  # DYN_LOG for both (Dynamo's default: info, a line per request)
    startup_timeout_s: float = 120.0,
    stop_grace_s: float = 5.0,
    log=print,
) -> Iterator[DynamoPeer]:
    python = dynamo_python(log)
    profile = profile if profile is not None else load_profile(profile_path(DEFAULT_PROFILE))
    work = Path(work).resolve()
    logs, kv, home = work / "logs", work / "discovery", work / "home"
    shutil.rmtree(kv, ignore_errors=True)  # a fresh discovery store: no stale instances
    for d in (logs, kv, home):
        d.mkdir(parents=True, exist_ok=True)
    npz = write_perf_npz(work / "mocker-perf.npz", profile, prompt_tokens)
    port = port or free_port()
    env = dynamo_env(work, log_level) | {"VIRTUAL_ENV": str(python.parent.parent)}  # its venv, not ours
    mocker_cmd = [
        str(python),
        "-m",
        "dynamo.mocker",
        "--model-path",
        str(model_dir),
        "--model-name",
        served_name,
        "--num-workers",
        str(workers),
        "--planner-profile-data",
        str(npz),
        "--block-size",
        str(profile.block_size),
        "--num-gpu-blocks-override",
        str(profile.kv_blocks),
        "--max-num-seqs",
        str(profile.max_seqs),
        "--max-num-batched-tokens",
        str(profile.max_batched_tokens),
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--speedup-ratio",
        "1.0",
    ]
    children: list[Child] = []
    try:
        for name, cmd in (("mocker", mocker_cmd), ("frontend", frontend_command(python, port, router_mode))):
            children.append(Child(name, cmd, env=env, log_path=logs / f"{name}.log"))
        mocker, frontend = children
        peer = DynamoPeer(
            f"http://127.0.0.1:{port}", served_name, workers, frontend.pid, [mocker.pid], logs, npz, children
        )
        _wait_ready(peer, kv, startup_timeout_s, router_mode)
        yield peer
    finally:
        stop_all(children[::-1], stop_grace_s)


def _wait_ready(peer: DynamoPeer, kv: Path, timeout_s: float, router_mode: str) -> None:
    """Until the frontend lists the model, all the workers registered and (round-robin) answered."""
    deadline = time.monotonic() + timeout_s
    state = "nothing yet"

    def failure(why: str) -> RuntimeError:
        return RuntimeError(
            f"Dynamo peer not ready: {why} (last: {state}).\n"
            + "".join(f"\n--- {child.log_path} (tail) ---\n{child.log_tail(30)}" for child in peer.children)
        )

    with httpx.Client(base_url=peer.url, timeout=5.0) as client:
        while True:
            for child in peer.children:
                if not child.alive():
                    raise failure(f"the {child.name} exited with {child.proc.returncode}")
            if time.monotonic() > deadline:
                raise failure(f"not ready after {timeout_s:.0f} s")
            registered = registered_workers(kv)
            try:
                models = [m["id"] for m in client.get("/v1/models").json()["data"]]
            except (httpx.HTTPError, ValueError, KeyError):
                models = []
            state = f"models {models}, {registered}/{peer.workers} workers registered"
            if peer.served_name in models and registered >= peer.workers:
                break
            time.sleep(0.2)
        if router_mode != "round-robin":
            return
        # round-robin: the frontend routes to every worker it knows in turn, so once as many one-token requests
        # as workers have each met a different one (its per-worker metrics), it knows them all
        while True:
            for _ in range(peer.workers):
                body = {"model": peer.served_name, "prompt": [5, 6, 7], "max_tokens": 1}
                client.post("/v1/completions", json=body, timeout=30.0).raise_for_status()
            seen = served_workers(client.get("/metrics").text)
            state = f"the frontend routed to {len(seen)}/{peer.workers} workers"
            if len(seen) >= peer.workers:
                return
            if time.monotonic() > deadline:
                raise failure(f"not ready after {timeout_s:.0f} s")
            time.sleep(0.5)


async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[list[float], int]:
    """One streamed completion: its token arrival times (s from the send) and usage's completion_tokens."""
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = -1
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                times.append(time.perf_counter() - t0)
    return times, tokens


async def _round(peer: DynamoPeer, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 10, max_keepalive_connections=len(prompts) + 10)
    async with httpx.AsyncClient(base_url=peer.url, timeout=600.0, limits=limits) as client:
        bodies = [
            {
                "model": peer.served_name,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                **({"ignore_eos": True} if ignore_eos else {}),
            }
            for prompt in prompts
        ]
        frontend0, mocker0, client0, wall0 = (
            peer.frontend_cpu_s(),
            peer.mocker_cpu_s(),
            time.process_time(),
            time.perf_counter(),
        )
        results = await asyncio.gather(*(_stream(client, body) for body in bodies))
        wall = time.perf_counter() - wall0
        frontend, mocker, own = (
            peer.frontend_cpu_s() - frontend0,
            peer.mocker_cpu_s() - mocker0,
            time.process_time() - client0,
        )
    n, tokens = len(results), sum(t for _, t in results)
    ttft = [times[0] for times, _ in results if times]
    itl = [(times[-1] - times[0]) / (len(times) - 1) for times, _ in results if len(times) > 1]
    gaps = [b - a for times, _ in results for a, b in zip(times, times[1:])]
    return {
        "requests": n,
        "tokens": tokens,
        "exact": all(t == max_tokens and len(times) == max_tokens for times, t in results),
        "wall_s": round(wall, 3),
        "frontend_cpu_s": round(frontend, 3),
        "frontend_cpu_ms_per_request": round(1e3 * frontend / n, 3),
        "frontend_cpu_us_per_token": round(1e6 * frontend / max(tokens, 1), 2),
        "mocker_cpu_ms_per_request": round(1e3 * mocker / n, 3),
        "client_cpu_ms_per_request": round(1e3 * own / n, 3),
        "ttft_ms_mean": round(1e3 * statistics.mean(ttft), 2) if ttft else None,
        "itl_ms_mean": round(1e3 * statistics.mean(itl), 3) if itl else None,
        "gap_ms_p50": round(1e3 * statistics.median(gaps), 3) if gaps else None,  # of all inter-token gaps
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--served-name", default="dynamo-peer")
    parser.add_argument("--work", type=Path, default=None, help="logs etc. (default: a fresh /tmp folder)")
    parser.add_argument("--router-mode", default="round-robin")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--requests", type=int, default=20, help="concurrent requests a round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-ignore-eos", action="store_true")
    parser.add_argument("--log-level", default=None, help="DYN_LOG (default: Dynamo's, info)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    work = args.work or Path(f"/tmp/dynamo-peer-{os.getpid()}")
    vocab = json.loads((args.model_dir / "config.json").read_text()).get("vocab_size", 2000)
    rng = random.Random(args.seed)

    def prompts() -> list[list[int]]:  # distinct random token ids: no prefix-cache hits
        return [[rng.randrange(3, max(4, vocab - 8)) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]

    with dynamo(
        args.model_dir,
        args.served_name,
        args.workers,
        work,
        router_mode=args.router_mode,
        port=args.port,
        prompt_tokens=args.prompt_tokens,
        log_level=args.log_level,
        log=say,
    ) as peer:
        say(
            f"dynamo peer at {peer.url}: frontend pid {peer.frontend_pid}, mocker pids {peer.mocker_pids}, "
            f"logs {peer.logs}"
        )
        asyncio.run(_round(peer, prompts()[:2], 8, True))  # warm-up (connections, first-request paths)
        for i in range(args.rounds):
            result = asyncio.run(_round(peer, prompts(), args.max_tokens, not args.no_ignore_eos))
            print(
                json.dumps(
                    {
                        "round": i,
                        "workers": args.workers,
                        "router_mode": args.router_mode,
                        "prompt_tokens": args.prompt_tokens,
                        "max_tokens": args.max_tokens,
                        **result,
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
