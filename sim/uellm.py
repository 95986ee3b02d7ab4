"""UELLM's batching experiment (issue 34): SLO-ODBS against S3's batching, in UELLM's own setup.

    .venv/bin/python -m llmesh_sim.uellm --out docs/sim/uellm-alpaca.md

UELLM's setup, from the authors' code (github.com/HYIUYOU/UELLM at 007c98f: UELM/UELM-batch/batch.py,
UELM/S3/s3.py, dataset/deal.py): 100 Alpaca instructions, all there at the start; each with a latency
target in seconds drawn by its position (the first 20 in 220-250 s, then 180-220, 150-180, 100-120 and
90-100); the requests cut into static batches (`llmesh.policies.uellm`) that one ChatGLM2-6B instance
runs one after another, each until its longest output; a request meets its target if its batch ends by
then. Its headline: 76.6% of requests within target with S3's batching, 100% with SLO-ODBS (with its
deployer beside it, which is not modelled here: one instance).

Here: AlpacaEval's instructions with text-davinci-003's answers (Alpaca's were text-davinci-003's;
`../shared/data/alpaca-eval`, characters / 4 as tokens, cut at 1,024 as SLO-ODBS's runs cut them), the
engine profile `--profile` (the H100 Llama-2-7B one by default: the nearest to a 6B model) timing a
static batch as its prompts' prefill then one step per token of its longest output, every request in it
decoding throughout (padded, as a static batch is). The batching reads predicted lengths: `--predictions`
oracle (the true length), real (the length predictor's held-out errors, `llmesh_sim.predictions`), none.
Beside them, plain batches of 10 in arrival order, and one vLLM engine (continuous batching, first come
first served) on the same requests.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from llmesh.policies import make_policy, make_queue_policy
from llmesh.policies.uellm import CHARS_PER_TOKEN, BatchItem, s3_batches, slo_odbs_batches

from .__main__ import DATA, PREDICTIONS, ROOT, command_line, length_means, load_profile, publish
from .cluster import simulate
from .engine import EngineProfile, SimRequest, attention_pairs
from .predictions import HeldOutPredictions, with_predictions

PAPER = "UELLM: 76.6% of requests within their latency target with S3's batching, 100% with SLO-ODBS"
ALPACA = DATA / "alpaca-eval" / "alpaca_eval_all_models_output_lengths.csv"
# dataset/deal.py: the latency targets (seconds) of each fifth of the 100 requests, by position
SLO_RANGES_S = ((220, 250), (180, 220), (150, 180), (100, 120), (90, 100))
MAX_OUTPUT = 1024
SYSTEMS = ("S3", "SLO-ODBS", "batches of 10", "vLLM")


@dataclass(frozen=True)
class Result:
    system: str
    predictions: str
    within_slo: float  # share of requests
    makespan_s: float
    mean_completion_s: float
    batches: int  # 0: continuous batching


def alpaca_requests(requests: int, seed: int, generator: str = "text_davinci_003") -> list[SimRequest]:
    """`requests` of the generator's AlpacaEval answers (one per instruction, shuffled), all at time 0,
    each with UELLM's latency target for its position (as `ttft_slo_s`: here the whole answer's)."""
    with ALPACA.open() as f:
        rows = list({r["instruction_sha1_12"]: r for r in csv.DictReader(f) if r["generator"] == generator}.values())
    rng = random.Random(seed)
    rng.shuffle(rows)
    out = []
    per_range = -(-requests // len(SLO_RANGES_S))
    for i, r in enumerate(rows[:requests]):
        low, high = SLO_RANGES_S[min(i // per_range, len(SLO_RANGES_S) - 1)]
        prompt = max(1, round(int(r["instruction_chars"]) / CHARS_PER_TOKEN))
        output = max(1, min(round(int(r["output_chars"]) / CHARS_PER_TOKEN), MAX_OUTPUT))
        out.append(SimRequest(f"r{i}", 0.0, prompt, output, ttft_slo_s=float(rng.randint(low, high))))
    return out


def static_batch_s(profile: EngineProfile, batch: list[SimRequest]) -> float:
    """A static batch's time: its prompts, padded to the longest, in one prefill; then one step per token of
    its longest output with every request decoding (padded) over the context so far."""
    n, prompt, steps = len(batch), max(r.prompt_tokens for r in batch), max(r.output_tokens for r in batch)
    total = profile.step_s(n * prompt, 0, 0, n * attention_pairs(0, prompt))
    for t in range(1, steps):
        total += profile.step_s(0, n, n * (prompt + t))
    return total


def run_static(requests: list[SimRequest], profile: EngineProfile, batches: list[list[int]]) -> list[float]:
    """Each request's completion time, the batches run one after another."""
    done, now = [0.0] * len(requests), 0.0
    for batch in batches:
        now += static_batch_s(profile, [requests[i] for i in batch])
        for i in batch:
            done[i] = now
    return done


def run(requests: list[SimRequest], profile: EngineProfile, system: str, predictions: str) -> Result:
    items = [BatchItem(r.ttft_slo_s or 0.0, r.predicted_tokens) for r in requests]
    if system == "vLLM":
        reqs = [replace(r, ttft_slo_s=None) for r in requests]
        simulate(reqs, profile, 1, make_policy("round_robin"), make_queue_policy("fcfs"), max_wait_s=1e9)
        done = [r.finished_at or float("inf") for r in reqs]
        batches = []
    else:
        if system == "S3":
            batches = s3_batches(items)
        elif system == "SLO-ODBS":
            batches = slo_odbs_batches(items)
        else:
            batches = [list(range(i, min(i + 10, len(items)))) for i in range(0, len(items), 10)]
        done = run_static(requests, profile, batches)
    within = sum(d <= (r.ttft_slo_s or 0.0) for d, r in zip(done, requests)) / len(requests)
    return Result(system, predictions, within, max(done), statistics.fmean(done), len(batches))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=ROOT / "sim" / "profiles" / "h100-llama2-7b.json")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--slo-scales", type=float, nargs="+", default=[1.0], help="every latency target times each (a row group each)"
    )
    parser.add_argument("--predictions", nargs="+", choices=PREDICTIONS, default=list(PREDICTIONS))
    parser.add_argument("--out", type=Path, help="write the table (markdown) here")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    heldout = HeldOutPredictions.load() if "real" in args.predictions else None
    results: dict[tuple[float, str, str], list[Result]] = {}
    means = []
    for seed in args.seeds:
        drawn = alpaca_requests(args.requests, seed)
        means.append(length_means(drawn))
        for scale in args.slo_scales:
            base = [replace(r, ttft_slo_s=(r.ttft_slo_s or 0.0) * scale) for r in drawn]
            for mode in args.predictions:
                requests = list(with_predictions([replace(r) for r in base], mode, seed, heldout))
                for system in SYSTEMS:
                    if system in ("batches of 10", "vLLM") and mode != args.predictions[0]:
                        continue  # they read no predictions
                    shown = mode if system in ("S3", "SLO-ODBS") else "-"
                    results.setdefault((scale, system, shown), []).append(run(requests, profile, system, shown))
    command = command_line("llmesh_sim.uellm", argv)
    lines = [
        f"Command: `{command}`",
        "",
        f"One engine of profile {profile.name}; {args.requests} requests of AlpacaEval's instructions with "
        f"text-davinci-003's answers, mean {statistics.fmean(m[0] for m in means):.0f} tokens in, "
        f"{statistics.fmean(m[1] for m in means):.0f} out, all at time 0; UELLM's latency targets by position "
        f"(90-250 s) times a scale; seeds {' '.join(map(str, args.seeds))} (the requests drawn, the "
        f"targets and the predictions), each row their mean (min-max). The paper: {PAPER}.",
        "",
        "| target scale | system | predictions | within target | makespan s | mean completion s | batches |",
        "|---|---|---|---|---|---|---|",
    ]
    for (scale, system, mode), rs in results.items():
        within = [r.within_slo for r in rs]
        makespan = statistics.fmean(r.makespan_s for r in rs)
        completion = statistics.fmean(r.mean_completion_s for r in rs)
        lines.append(
            f"| {scale:g} | {system} | {mode} | {statistics.fmean(within):.1%} ({min(within):.0%}-{max(within):.0%}) "
            f"| {makespan:.1f} | {completion:.1f} | {statistics.fmean(r.batches for r in rs):.1f} |"
        )
        print(lines[-1], file=sys.stderr)
    publish("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
