"""AdaptiveLLM's experiment (issue 34): swap or recompute a preempted request's KV, in the simulator.

    .venv/bin/python -m llmesh_sim.adaptive --out docs/sim/adaptive-h100.md

One engine under AdaptiveLLM's memory pressure: 128 blocks of 16 tokens of device KV and 64 of CPU
swap space (`--kv-blocks`, `--cpu-blocks`), the profile's compute (`--profile`; by default Llama-2-7B
on an H100). A swapped block costs its bytes (`--kv-bytes-per-token`, Llama-2-7B's 512 KiB) over the
host link (`--swap-gbps`, 25 GB/s: vLLM V0 copies a block a layer, K and V apart, 128 KiB pieces, which
move at 20-55 GB/s pinned on an H200, `../shared/design/facts.md`) each way. ShareGPT's lengths
(`sharegpt-lengths-sarathi`, cut to the 2048 tokens the KV holds, `llmesh_sim.workload`), all
requests at once (offline throughput, `--offline`) or Poisson arrivals at `--rates`.

Systems (`SimEngine` with a `Preemption`):
- recompute: vLLM's default; the request admitted last is the victim, its KV dropped and computed again;
- swap: vLLM V0's swap space; the same victim, its KV copied out and back (recomputed when the CPU space
  is full, where vLLM V0 would abort it);
- adaptive: AdaptiveLLM; the victim by fairness priority (time in the system over predicted length),
  swap or recompute by their costs at preemption time (`llmesh.policies.preemption.swap_or_recompute`),
  swap only where the CPU space holds it; with predictions from the real predictor's held-out errors,
  an oracle, or none (`--predictions`);
- cost-only: adaptive's choice with vLLM's victim, to tell the two mechanisms apart.

Reported per system: output tokens per second over the run, mean turnaround (arrival to last token),
mean normalized turnaround (seconds per output token: every request weighs the same whatever its
length; AdaptiveLLM's "weighted turnaround" is not defined in what we have of it, so both are given),
and the preemptions by kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from llmesh.policies import make_policy, make_queue_policy

from .__main__ import ROOT, command_line, load_profile, publish, read_trace, workload
from .cluster import simulate
from .engine import EngineProfile, Preemption, SimRequest
from .predictions import HeldOutPredictions, with_predictions

PAPER = (
    "AdaptiveLLM: up to 1.40x the throughput of always-recompute and 2.55x of always-swap; "
    "20-40% lower weighted turnaround"
)


@dataclass(frozen=True)
class Result:
    system: str
    predictions: str
    tokens_per_s: float
    turnaround_s: float
    normalized_s: float  # per output token
    preemptions: int
    swaps: int
    preempted_share: float  # of the run's time, what preemptions cost (copies, or prefill computed again)
    refused: int


def systems(cpu_blocks: int, swap_block_s: float) -> dict[str, Preemption]:
    return {
        "recompute": Preemption("recompute"),
        "swap": Preemption("swap", cpu_blocks, swap_block_s),
        "adaptive": Preemption("auto", cpu_blocks, swap_block_s, victim="fairness"),
        "cost-only": Preemption("auto", cpu_blocks, swap_block_s),
    }


def run(requests: list[SimRequest], profile: EngineProfile, preemption: Preemption) -> list[SimRequest]:
    fresh = [replace(r) for r in requests]
    return simulate(
        fresh,
        profile,
        1,
        make_policy("least_loaded"),
        make_queue_policy("fcfs"),
        max_wait_s=float("inf"),
        preemption=preemption,
    )


def measure(system: str, predictions: str, done: list[SimRequest]) -> Result:
    finished = [r for r in done if r.finished_at is not None]
    span = max(r.finished_at or 0.0 for r in finished) - min(r.arrival for r in done)
    return Result(
        system,
        predictions,
        sum(r.output_tokens for r in finished) / span,
        statistics.fmean(r.finished_at - r.arrival for r in finished),  # type: ignore[operator]
        statistics.fmean((r.finished_at - r.arrival) / r.output_tokens for r in finished),  # type: ignore[operator]
        sum(r.preemptions for r in done),
        sum(r.swaps for r in done),
        sum(r.preempted_s for r in done) / span,
        sum(r.refused for r in done),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=ROOT / "sim" / "profiles" / "h100-llama2-7b.json")
    parser.add_argument("--kv-blocks", type=int, default=128)
    parser.add_argument("--cpu-blocks", type=int, default=64)
    parser.add_argument("--kv-bytes-per-token", type=int, default=2 * 32 * 4096 * 2)
    parser.add_argument("--swap-gbps", type=float, default=25.0)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--input-scale",
        type=float,
        default=0.125,
        help="prompt lengths scaled (the file's are whole conversations, mean 2340; ShareGPT's first turns ~300)",
    )
    parser.add_argument("--offline", action="store_true", help="every request at 0 (besides --rates)")
    parser.add_argument("--rates", type=float, nargs="*", default=[])
    parser.add_argument("--predictions", nargs="+", default=["real", "oracle", "none"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the tables (markdown) here")
    args = parser.parse_args(argv)
    base = load_profile(args.profile)
    profile = replace(base, kv_blocks=args.kv_blocks)
    context = args.kv_blocks * profile.block_size
    swap_block_s = profile.block_size * args.kv_bytes_per_token / (args.swap_gbps * 1e9)
    heldout = HeldOutPredictions.load()
    trace = read_trace("sharegpt", args.seed)
    loads = (["offline"] if args.offline else []) + [f"{rate:g}" for rate in args.rates]
    command = command_line("llmesh_sim.adaptive", argv)
    lines = [
        f"Command: `{command}`",
        "",
        f"One engine, profile {base.name} with {args.kv_blocks} device blocks of {profile.block_size} tokens and "
        f"{args.cpu_blocks} CPU blocks; a block swaps in {swap_block_s * 1e3:.3f} ms each way "
        f"({args.kv_bytes_per_token / 1024:g} KiB a token at {args.swap_gbps:g} GB/s); a lone {context}-token "
        f"prompt computes in {base.prefill_s(context) * 1e3:.1f} ms. {args.requests} ShareGPT requests "
        f"(seed {args.seed}). The paper: {PAPER}.",
    ]
    for load in loads:
        rate = 1e9 if load == "offline" else float(load)
        requests = workload(trace, args.requests, rate, args.input_scale, 1.0, context, float("inf"), float("inf"))
        if load == "offline":
            requests = [replace(r, arrival=0.0) for r in requests]
        results = []
        for system, preemption in systems(args.cpu_blocks, swap_block_s).items():
            for mode in args.predictions if preemption.victim == "fairness" else ["-"]:
                if mode != "-":
                    with_predictions(requests, mode, args.seed, heldout)
                results.append(measure(system, mode, run(requests, profile, preemption)))
                print(f"{load}: {system} ({mode}) {results[-1].tokens_per_s:.0f} tok/s", file=sys.stderr)
        lines += ["", *table(load, results)]
    publish("\n".join(lines) + "\n", args.out)
    return 0


def table(load: str, results: list[Result]) -> list[str]:
    by = {r.system: r for r in results if r.predictions in ("-", "real")}
    title = "all requests at once" if load == "offline" else f"Poisson arrivals at {load} req/s"
    lines = [
        f"{title}:",
        "",
        "| system | predictions | output tok/s | vs recompute | vs swap | turnaround s | normalized s/token "
        "| preemptions | of them swapped | their cost, share of the run | refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.system} | {r.predictions} | {r.tokens_per_s:.0f} "
            f"| {r.tokens_per_s / by['recompute'].tokens_per_s:.2f}x | {r.tokens_per_s / by['swap'].tokens_per_s:.2f}x "
            f"| {r.turnaround_s:.2f} | {r.normalized_s * 1e3:.1f} ms "
            f"| {r.preemptions} | {r.swaps} | {r.preempted_share:.1%} | {r.refused} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
