"""Engine activation in a pre-started process against a cold engine start (issue 33, part 4), in one run.

    .venv/bin/python bench/activation.py [--models tiny small] [--modes cold pool-spawn pool-fork reload]
                                         [--repeats 3] [--max-tokens 8] [--out FILE]

For each model and repetition, alternating the modes (each in a fresh process):

- `cold`: a new process imports torch, transformers and vLLM, builds the mesh worker's engine (the
  worker's engine arguments, without its KV connector, which needs the bus) and generates the first
  token of a fixed greedy prompt. Time: from the process's start (the parent's `Popen`) to that token.
- `pool-spawn`: a pre-started process has done the imports and waits; the command names the model and
  it builds the engine as `cold` does. vLLM on CPU spawns its EngineCore and Worker processes, and
  each new interpreter imports torch and vLLM again.
- `pool-fork`: as `pool-spawn`, but the pre-started process has also imported vLLM's engine, worker and
  Llama modules, set its cores' OpenMP environment before importing torch and frozen its heap
  (`gc.freeze`), and vLLM starts its EngineCore and Worker by `fork` (the CPU platform forces `spawn`;
  this sets VLLM_WORKER_MULTIPROC_METHOD=fork after the config is made), so they inherit all of it.
- `reload`: a pre-started, warmed engine built for a model of the same architecture and shapes but other
  weights (llmesh/tiny-llama-b for tiny; a small-llama sibling with another seed, built here) takes the
  model's weights in place (`collective_rpc("reload_weights", weights_path=...)`, vLLM's
  `vllm/model_executor/model_loader/reload/inplace.py`) and drops its prefix cache.

Activation time: from the command written to the process to the first token. Every mode's greedy
output must equal the cold engine's (same model, same prompt); a difference is reported and fails the
run (exit status 1). Phases of each start come from vLLM's own log lines (timestamped in milliseconds
through VLLM_LOGGING_CONFIG_PATH) and the process's own marks. Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmesh.engine import standby

MODELS = {"tiny": "llmesh/tiny-llama", "small": "llmesh/small-llama"}
SIBLINGS = {"tiny": "llmesh/tiny-llama-b", "small": "bench-activation/small-llama-b"}  # same shapes, other weights
SIBLING_SEED = 4321
MODES = ("cold", "pool-spawn", "pool-fork", "reload")
PROMPT = [(i * 7919) % 1000 + 3 for i in range(200)]  # token ids; more than one 128-token block is cached
RESULT = "@@RESULT "
READY = "@@READY"
LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"t": {"format": "@%(created).3f %(processName)s %(name)s %(message)s"}},
    "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "t", "stream": "ext://sys.stderr"}},
    "loggers": {"vllm": {"handlers": ["h"], "level": "DEBUG", "propagate": False}},
}
# Phases of an engine start: (name, the mark that ends it). Marks come from the process itself
# (`imports`, `build`, `built`, `first`) and from vLLM's log lines (`LOG_MARKS`); a phase runs from the
# previous mark found to its own. A phase whose mark is absent (a mode that skips it) is left out.
PHASES = (
    ("interpreter + imports (torch, transformers, vllm, llmesh)", "imports"),
    ("engine config made (command received, for a pool)", "build"),
    ("tokenizer, renderer (API process)", "api_configured"),
    ("EngineCore process start + its imports", "core_up"),
    ("Worker process start + its imports", "worker_up"),
    ("worker init (device, distributed, model runner)", "load_start"),
    ("model built, weights read (safetensors)", "weights_read"),
    ("weights post-processed, worker ready (to KV sizing)", "kv_start"),
    ("KV cache allocation", "kv_done"),
    ("EngineCore ready (scheduler, tokenizer)", "ready"),
    ("client set up", "built"),
    ("weights reloaded in place", "reloaded"),
    ("prefix cache reset", "reset"),
    ("first token (prefill of the prompt)", "first"),
)
LOG_MARKS = (  # (mark, process name prefix, message prefix): the first such line after the previous mark
    ("api_configured", "MainProcess", "vllm.renderers.registry Loading"),
    ("core_up", "EngineCore", ""),
    ("worker_up", "VllmWorker", ""),
    ("load_start", "VllmWorker", "vllm.v1.worker.cpu_model_runner Starting to load model"),
    ("weights_read", "VllmWorker", "vllm.model_executor.model_loader.default_loader Loading weights took"),
    ("kv_start", "VllmWorker", "vllm.v1.worker.cpu_worker Explicitly set"),
    ("kv_done", "EngineCore", "vllm.v1.engine.core init engine"),
    ("ready", "MainProcess", "vllm.v1.engine.utils READY"),
)


# ---- the measured process ------------------------------------------------------------------------


def _engine_args(path: str) -> Any:
    """The mesh worker's engine arguments (`llmesh.engine.worker.engine_args`, its settings' defaults)
    without the KV connector, which needs NATS and Redis."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from llmesh.wire.config import WorkerSettings

    default = {name: field.default for name, field in WorkerSettings.model_fields.items()}
    return AsyncEngineArgs(
        model=path,
        dtype=default["dtype"],
        block_size=default["block_size"],
        max_model_len=default["max_model_len"],
        enforce_eager=True,
        max_num_seqs=default["capacity"],
        disable_log_stats=True,
    )


async def _first_token(engine: Any, marks: dict[str, float], max_tokens: int, request_id: str) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens: list[int] = []
    async for out in engine.generate(
        TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id
    ):
        marks.setdefault("first", time.time())
        tokens = list(out.outputs[0].token_ids)
    return tokens


async def _build(path: str, fork: bool, marks: dict[str, float]) -> Any:
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.abstract import Executor

    config = _engine_args(path).create_engine_config(UsageContext.ENGINE_CONTEXT)
    marks["build"] = time.time()
    if fork:  # after the config: the CPU platform's `check_and_update_config` sets spawn
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    engine = AsyncLLM(vllm_config=config, executor_class=Executor.get_class(config), log_stats=False)
    marks["built"] = time.time()
    return engine


def _import_all(mode: str) -> None:
    if mode == "pool-fork":  # what a pre-started mesh worker does (llmesh.engine.standby)
        standby.prepare(os.environ["VLLM_CPU_OMP_THREADS_BIND"])
        return
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import vllm  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

    import llmesh.engine.worker  # noqa: F401  (a mesh worker imports it)


async def _child(mode: str, model: str, max_tokens: int) -> None:
    marks: dict[str, float] = {}
    _import_all(mode)
    marks["imports"] = time.time()
    from llmesh.engine.models import resolve_model

    engine = None
    if mode == "cold":
        engine = await _build(resolve_model(model, _model_dir()), False, marks)
    else:
        if mode == "reload":  # a warmed engine of the same shapes, as a pool would keep it
            engine = await _build(_sibling_path(model), False, marks)
            await _first_token(engine, {}, 2, "warm-up")
        print(READY, flush=True)
        command = json.loads(sys.stdin.readline())
        marks.clear()
        marks["command"] = time.time()
        path = resolve_model(command["model"], _model_dir())
        if mode == "reload":
            assert engine is not None
            await engine.collective_rpc("reload_weights", kwargs={"weights_path": path})
            marks["reloaded"] = time.time()
            await engine.reset_prefix_cache()  # its KV was computed with the old weights
            marks["reset"] = time.time()
        else:
            engine = await _build(path, mode == "pool-fork", marks)
    tokens = await _first_token(engine, marks, max_tokens, "measured")
    print(RESULT + json.dumps({"marks": marks, "tokens": tokens}), flush=True)
    engine.shutdown()


def _model_dir() -> Path:
    return Path.home() / ".cache" / "llmesh"


def _sibling_path(model: str) -> str:
    """The path of a model with `model`'s shapes and tokenizer and other weights (built on first use)."""
    from llmesh.engine.models import EMBEDDED, build_model, resolve_model

    key = next(k for k, name in MODELS.items() if name == model)
    sibling = SIBLINGS[key]
    if sibling in EMBEDDED:
        return resolve_model(sibling, _model_dir())
    target = _model_dir() / sibling
    if not (target / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=_model_dir(), prefix=".sibling-"))
        build_model(tmp, *EMBEDDED[model], seed=SIBLING_SEED)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(target)
    return str(target)


# ---- the driver --------------------------------------------------------------------------------------


def _log_marks(log: str, after: float) -> dict[str, float]:
    """Times of vLLM's log lines that end phases, each the first after the previous one found."""
    lines = []
    for line in log.splitlines():
        m = re.match(r"@(\d+\.\d+) (\S+) (.*)", line)
        if m and float(m[1]) >= after:
            lines.append((float(m[1]), m[2], m[3]))
    found: dict[str, float] = {}
    start = 0
    for mark, process, message in LOG_MARKS:
        for i in range(start, len(lines)):
            t, proc, text = lines[i]
            if proc.startswith(process) and text.startswith(message):
                found[mark], start = t, i
                break
    return found


def _phases(marks: dict[str, float], start: float) -> dict[str, float]:
    phases, last = {}, start
    for name, mark in PHASES:
        if mark in marks and marks[mark] >= last:
            phases[name], last = marks[mark] - last, marks[mark]
    return phases


def run_one(mode: str, model: str, max_tokens: int, env: dict[str, str], logs: Path) -> dict[str, Any]:
    """One start in a fresh process; the seconds to the first token and its phases."""
    args = [sys.executable, __file__, "--child", mode, "--model", model, "--max-tokens", str(max_tokens)]
    log_path = logs / f"{mode}-{model.split('/')[-1]}-{time.time():.0f}.log"
    with open(log_path, "w") as log:
        started = time.time()
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert proc.stdin and proc.stdout
        start, prepared = started, None
        result: dict[str, Any] | None = None
        for line in proc.stdout:
            if line.startswith(READY):
                time.sleep(2.0)  # let the pre-started process settle (idle) before the command
                prepared = time.time() - started
                start = time.time()
                proc.stdin.write(json.dumps({"model": model}) + "\n")
                proc.stdin.flush()
            elif line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
        proc.wait(timeout=60)
    if result is None:
        raise RuntimeError(f"{mode} {model}: no result (exit {proc.returncode}); see {log_path}")
    marks = result["marks"]
    if "build" in marks:  # an engine was started: its phases from vLLM's log
        marks |= _log_marks(log_path.read_text(), start)
    return {
        "mode": mode,
        "model": model,
        "seconds": marks["first"] - start,
        "prepared_s": prepared,
        "phases": _phases(marks, start),
        "tokens": result["tokens"],
        "log": str(log_path),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _minmax(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model and mode: seconds (median, min, max), the ratio of medians to cold, the median phases,
    and whether every run's tokens equal the cold runs'."""
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        cold = [r for r in runs if r["model"] == model and r["mode"] == "cold"]
        reference = cold[0]["tokens"] if cold else None
        cold_median = statistics.median(r["seconds"] for r in cold) if cold else None
        for mode in dict.fromkeys(r["mode"] for r in runs if r["model"] == model):
            mine = [r for r in runs if r["model"] == model and r["mode"] == mode]
            seconds = _spread([r["seconds"] for r in mine])
            names = dict.fromkeys(name for r in mine for name in r["phases"])
            out.setdefault(model, {})[mode] = {
                "runs": len(mine),
                "seconds": seconds,
                "ratio_to_cold": seconds["median"] / cold_median if cold_median else None,
                "phases": {n: statistics.median(r["phases"].get(n, 0.0) for r in mine) for n in names},
                "phase_spread": {n: _minmax([r["phases"].get(n, 0.0) for r in mine]) for n in names},
                "exact": None if reference is None else all(r["tokens"] == reference for r in mine),
                "tokens": mine[0]["tokens"],
            }
    return out


def table(summary: dict[str, Any]) -> str:
    rows = [f"{'model':20} {'mode':11} {'n':>2} {'median s':>9} {'min':>7} {'max':>7} {'x cold':>7}  exact"]
    for model, modes in summary.items():
        for mode, s in modes.items():
            ratio = f"{s['ratio_to_cold']:.3f}" if s["ratio_to_cold"] is not None else "-"
            sec = s["seconds"]
            rows.append(
                f"{model:20} {mode:11} {s['runs']:>2} {sec['median']:9.2f} {sec['min']:7.2f} {sec['max']:7.2f} "
                f"{ratio:>7}  {'-' if s['exact'] is None else 'yes' if s['exact'] else 'NO'}"
            )
    rows.append("")
    for model, modes in summary.items():
        for mode, s in modes.items():
            rows.append(f"{model} {mode}: phases, median seconds [min-max]")
            for name, value in s["phases"].items():
                lo, hi = s["phase_spread"][name]
                rows.append(f"    {value:7.3f} [{lo:.3f}-{hi:.3f}]  {name}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--cores",
        default=str(min(os.sched_getaffinity(0))),
        help="the engine's cores (VLLM_CPU_OMP_THREADS_BIND and MESH_ENGINE_CORES, as a worker's MESH_CPU_CORES "
        "sets them; a pool slot has its cores before it has a model); default: the first allowed core",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--logs", type=Path, help="where the runs' vLLM logs go (default: a temporary folder)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_child(args.child, args.model, args.max_tokens))
        os._exit(0)  # vLLM's shutdown waits seconds for its processes; the measurement is done

    logs = args.logs or Path(tempfile.mkdtemp(prefix="activation-"))
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "logging.json").write_text(json.dumps(LOG_CONFIG))
    env = os.environ | {
        "VLLM_LOGGING_CONFIG_PATH": str(logs / "logging.json"),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "MESH_ENGINE_SPIN_S": os.environ.get("MESH_ENGINE_SPIN_S", "0.02"),  # as a mesh worker on CPU sets it
        "VLLM_CPU_OMP_THREADS_BIND": args.cores,
        "MESH_ENGINE_CORES": args.cores,
    }
    from llmesh.engine.models import resolve_model

    for key in args.models:  # built before any timing
        resolve_model(MODELS[key], _model_dir())
        if "reload" in args.modes:
            _sibling_path(MODELS[key])
    runs = []
    for rep in range(args.repeats):
        for key in args.models:
            for mode in args.modes:
                run = run_one(mode, MODELS[key], args.max_tokens, env, logs)
                runs.append(run)
                print(f"[{rep + 1}/{args.repeats}] {key:5} {mode:10} {run['seconds']:7.2f} s", flush=True)
    summary = summarize(runs)
    print(table(summary))
    print(f"logs: {logs}")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "runs": runs, "prompt": PROMPT}, indent=1))
    if any(s["exact"] is False for modes in summary.values() for s in modes.values()):
        sys.exit("an activated engine's output differs from the cold engine's")


if __name__ == "__main__":
    main()
