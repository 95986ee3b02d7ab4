"""Llumnix's experiment (issue 34): dispatch by freeness and live migration on instances short of KV, in
the simulator.

    .venv/bin/python -m llmesh_sim.llumnix --out docs/sim/llumnix-h100.md

Llumnix's setup as far as we have it: 16 instances of LLaMA-7B on 24 GB GPUs, where KV is tight;
ShareGPT and long-tail lengths; Poisson and Gamma arrivals. Here: `--instances` engines with
`--kv-blocks` blocks of 16 tokens each (900: a 24 GB A10 at vLLM's 0.9 of its memory, less 13.5 GB of
weights and ~1 GB of activations, over 8 MiB a block), the H100 Llama-2-7B profile's compute (no A10
profile is fitted: an A10 computes several times slower, so these runs are shorter of memory than of
compute, which is the regime Llumnix is about); vLLM's preemption by recompute. Lengths (`--lengths`):
ShareGPT's (`sharegpt-lengths-sarathi`, prompts scaled by `--input-scale` to first-turn sizes), or a
long tail as Llumnix generates one (power-law: Pareto with shape 1.5, inputs from 64 and outputs from 128
tokens, cut to the context: means of about 180 and 340; the paper's exact parameters are not in what we
have of it); arrivals Gamma with `--cv` (1: Poisson) at `--rates`.

Systems:
- round-robin: vLLM's multi-instance default;
- INFaaS++: Llumnix's baseline, dispatch to the instance of the lowest memory load (the KV blocks in
  use over the total, and those of the prompts sent it since its heartbeat), no migration;
- Llumnix dispatch: the production `llumnix` policy (freeness, with the virtual usage of queued
  requests), no migration, to tell dispatch and migration apart;
- Llumnix: the same dispatch and placement's migration (`llmesh_sim.cluster.Migration`: its period and
  thresholds as placement's defaults, the KV copied while the request decodes on at the profile's
  transfer speed, then `--downtime-ms` of pause, Llumnix's near-constant downtime).

Reported: prefill latency (TTFT) mean and P99, decode latency (mean time per output token) mean and
P99, preemption loss (a request's time back in the queue after preemptions and its prompt computed
again, mean over all requests), preemptions and migrations.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from llmesh.policies import Policy, make_policy, make_queue_policy

from .__main__ import ROOT, arrivals, command_line, length_means, load_profile, publish, read_trace, workload
from .cluster import Migration, percentile, simulate
from .engine import EngineProfile, Preemption, SimRequest

PAPER = "Llumnix: P99 prefill latency up to 15x lower than INFaaS++; preemption loss 84% lower than round-robin"
# the lowest memory load: the KV blocks in use, and those of the prompts sent since the heartbeat, over the total
INFAAS_PP = Policy(
    "infaas++", costs=((1.0, lambda ctx, w: (w.kv_blocks_used + w.assigned_blocks) / max(w.kv_blocks_total, 1)),)
)
SYSTEMS: dict[str, tuple[Policy, bool]] = {  # dispatch, migration
    "round-robin": (make_policy("round_robin"), False),
    "INFaaS++": (INFAAS_PP, False),
    "Llumnix dispatch": (make_policy("llumnix"), False),
    "Llumnix": (make_policy("llumnix"), True),
    "Llumnix, head-of-line dispatch": (make_policy("llumnix", {"head_of_line": 1}), True),
}


@dataclass(frozen=True)
class Result:
    system: str
    prefill_mean_s: float
    prefill_p99_s: float
    decode_mean_s: float
    decode_p99_s: float
    preemption_loss_s: float
    preemptions: int
    migrations: int
    incomplete: int


def long_tail(requests: int, context: int, seed: int) -> list[SimRequest]:
    rng, out = random.Random(seed), []
    for i in range(requests):
        prompt = min(int(rng.paretovariate(1.5) * 64), context * 3 // 4)
        out.append(
            SimRequest(f"r{i}", 0.0, prompt, max(1, min(int(rng.paretovariate(1.5) * 128), context - prompt - 1)))
        )
    return out


def run(
    requests: list[SimRequest],
    profile: EngineProfile,
    instances: int,
    system: str,
    migration: Migration,
    heartbeat_views: bool = False,
) -> Result:
    policy, migrates = SYSTEMS[system]
    done = simulate(
        [replace(r) for r in requests],
        profile,
        instances,
        policy,
        make_queue_policy("fcfs"),
        max_wait_s=float("inf"),
        preemption=Preemption("recompute"),
        migration=migration if migrates else None,
        heartbeat_views=heartbeat_views,
    )
    finished = [r for r in done if r.finished_at is not None]
    ttfts = [r.ttft_s for r in finished if r.ttft_s is not None]
    tpots = [r.tpot_s for r in finished if r.tpot_s is not None]
    return Result(
        system,
        statistics.fmean(ttfts),
        percentile(ttfts, 0.99),
        statistics.fmean(tpots),
        percentile(tpots, 0.99),
        statistics.fmean(r.requeued_s + r.preempted_s for r in done),
        sum(r.preemptions for r in done),
        sum(r.migrations for r in done),
        len(done) - len(finished),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=ROOT / "sim" / "profiles" / "h100-llama2-7b.json")
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=900)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--lengths", choices=["sharegpt", "long-tail"], default="sharegpt")
    parser.add_argument("--input-scale", type=float, default=0.125, help="ShareGPT's, as llmesh_sim.adaptive's")
    parser.add_argument("--rates", type=float, nargs="+", default=[20.0])
    parser.add_argument("--cv", type=float, nargs="+", default=[1.0], help="arrivals' coefficient of variation")
    parser.add_argument("--downtime-ms", type=float, default=30.0)
    parser.add_argument(
        "--heartbeat-views",
        action="store_true",
        help="dispatch on each instance's last heartbeat (1 s) plus what was sent it since, as the router does; "
        "placement on the heartbeat alone (default: every decision sees the exact state)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the tables (markdown) here")
    args = parser.parse_args(argv)
    base = load_profile(args.profile)
    profile = replace(base, kv_blocks=args.kv_blocks)
    context = min(4096, args.kv_blocks * profile.block_size)
    migration = Migration(
        copy_block_s=profile.kv_transfer_token_s * profile.block_size, downtime_s=args.downtime_ms / 1000
    )
    if args.lengths == "sharegpt":
        trace = read_trace("sharegpt", args.seed)
        rows = workload(trace, args.requests, 1.0, args.input_scale, 1.0, context, float("inf"), float("inf"))
        lengths = f"ShareGPT's lengths (prompts x{args.input_scale:g})"
    else:
        rows = long_tail(args.requests, context, args.seed)
        lengths = "long-tail lengths"
    means = length_means(rows)
    command = command_line("llmesh_sim.llumnix", argv)
    lines = [
        f"Command: `{command}`",
        "",
        f"{args.instances} instances, profile {base.name} with {args.kv_blocks} KV blocks of {profile.block_size} "
        f"tokens each; vLLM's preemption by recompute; {args.requests} requests of {lengths}, mean "
        f"{means[0]:.0f} in, {means[1]:.0f} out (seed {args.seed}); migration every {migration.interval_s:g} s from "
        f"freeness < {migration.source_below:g} to > {migration.destination_above:g}, {args.downtime_ms:g} ms "
        f"downtime. The paper: {PAPER}.",
    ]
    for cv in args.cv:
        for rate in args.rates:
            requests = arrivals(rows, rate, cv, args.seed)
            results = []
            for system in SYSTEMS:
                results.append(run(requests, profile, args.instances, system, migration, args.heartbeat_views))
                print(
                    f"cv {cv:g}, {rate:g} req/s: {system} P99 prefill {results[-1].prefill_p99_s:.2f} s",
                    file=sys.stderr,
                )
            lines += ["", *table(rate, cv, results)]
    publish("\n".join(lines) + "\n", args.out)
    return 0


def table(rate: float, cv: float, results: list[Result]) -> list[str]:
    by = {r.system: r for r in results}
    lines = [
        f"{'Poisson' if cv == 1 else f'Gamma (CV {cv:g})'} arrivals at {rate:g} req/s:",
        "",
        "| system | prefill mean s | prefill P99 s | INFaaS++ / this (P99) | decode mean ms/token | decode P99 "
        "| preemption loss mean s | round-robin / this (loss) | preemptions | migrations | incomplete |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        loss_ratio = by["round-robin"].preemption_loss_s / r.preemption_loss_s if r.preemption_loss_s else None
        lines.append(
            f"| {r.system} | {r.prefill_mean_s:.3f} | {r.prefill_p99_s:.3f} "
            f"| {by['INFaaS++'].prefill_p99_s / r.prefill_p99_s:.2f}x | {r.decode_mean_s * 1e3:.1f} "
            f"| {r.decode_p99_s * 1e3:.1f} | {r.preemption_loss_s:.3f} "
            f"| {'-' if loss_ratio is None else f'{loss_ratio:.2f}x'} "
            f"| {r.preemptions} | {r.migrations} | {r.incomplete} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
