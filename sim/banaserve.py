"""BanaServe's experiment (issue 34): prefill/decode disaggregation with load-aware dispatch and role
switching against monolithic vLLM instances and DistServe's static split, in the simulator.

    .venv/bin/python -m llmesh_sim.banaserve --out docs/sim/banaserve-alpaca.md

BanaServe's setup as far as we have it: LLaMA-13B (and OPT-13B) on A100s, Alpaca and LongBench prompts,
Poisson arrivals at 1-20 req/s, outputs cut at 512 tokens; baselines vLLM (monolithic) and DistServe
(a static prefill/decode split); its headline: 1.2-3.9x their throughput, and +40% over vLLM on the
Azure trace. Here: `--instances` engines of the A100 Llama-2-13B profile (`llmesh_sim.gpu_profile
--target a100-llama2-13b`); lengths (`--lengths`) of AlpacaEval's 805 instructions with Llama-2-13B-chat's
answers to them (`../shared/data/alpaca-eval`, characters / 4 as tokens: no tokenizer is at hand; cut at
`--max-output`), or the Azure 2023 conversation trace's; LongBench is not in `../shared/data`.

Systems:
- vLLM: every engine runs whole requests, round-robin; with V1's chunked prefill (prompts and decodes in
  one step), and as V0 scheduled by default (`prefill_first`: a step that computes prompts decodes
  nothing), the vLLM of BanaServe's time;
- DistServe: a static split, `--prefill` prefill engines and the rest decode, each request's KV handed
  over at the profile's transfer speed; dispatch to the least loaded of each pool;
- BanaServe: the same split to start with, BanaServe's dispatch (Algorithm 4-2, `banaserve`) and
  placement's role switching (`llmesh_sim.cluster.RoleSwitching`: the production `pick_role_switch` every
  second, placement's defaults);
- BanaServe 4-1: the same, with Algorithm 4-1 per device instead (`llmesh_sim.cluster.ModuleMigration`:
  `plan_module_migrations` every second, its defaults, KV moved at the profile's transfer speed).

Reported per rate: throughput (requests and output tokens a second, from the first arrival to the last
completion), TTFT and TPOT means and P99s, and BanaServe's role switches.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from llmesh.policies import make_policy, make_queue_policy
from llmesh.policies.banaserve import ModuleMigrationParams, RoleSwitchParams

from .__main__ import DATA, ROOT, arrivals, command_line, length_means, load_profile, publish, read_trace, workload
from .cluster import ModuleMigration, RoleSwitching, percentile, run_span_s, simulate
from .engine import EngineProfile, SimRequest

PAPER = "BanaServe: 1.2-3.9x the throughput of vLLM and DistServe; +40% over vLLM on the Azure trace"
ALPACA = DATA / "alpaca-eval" / "alpaca_eval_all_models_output_lengths.csv"
CHARS_PER_TOKEN = 4
SYSTEMS = ("vLLM", "vLLM V0", "DistServe", "BanaServe", "BanaServe 4-1")


@dataclass(frozen=True)
class Result:
    system: str
    requests_per_s: float
    tokens_per_s: float
    ttft_mean_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p99_s: float
    switches: str  # BanaServe's: how many to each role
    kv_moves: int  # BanaServe 4-1's requests moved between decode devices
    incomplete: int


def alpaca(requests: int, max_output: int, seed: int, generator: str = "llama-2-13b-chat-hf") -> list[SimRequest]:
    """`requests` drawn in turn from a shuffled pass over the generator's AlpacaEval answers."""
    with ALPACA.open() as f:
        rows = [r for r in csv.DictReader(f) if r["generator"] == generator]
    random.Random(seed).shuffle(rows)
    out = []
    for i in range(requests):
        r = rows[i % len(rows)]
        prompt = max(1, round(int(r["instruction_chars"]) / CHARS_PER_TOKEN))
        output = max(1, min(round(int(r["output_chars"]) / CHARS_PER_TOKEN), max_output))
        out.append(SimRequest(f"r{i}", 0.0, prompt, output))
    return out


def default_module_params(profile: EngineProfile, **knobs: float) -> ModuleMigrationParams:
    """BanaServe 4-1's knobs: `knobs`, a KV block moved at the profile's transfer speed unless they say."""
    return ModuleMigrationParams(**{"block_s": profile.block_size * profile.kv_transfer_token_s, **knobs})


def run(
    requests: list[SimRequest],
    profile: EngineProfile,
    instances: int,
    prefill: int,
    system: str,
    switch_params: RoleSwitchParams = RoleSwitchParams(),
    module_params: ModuleMigrationParams | None = None,
) -> Result:
    reqs = [replace(r) for r in requests]
    switching = RoleSwitching(params=switch_params) if system == "BanaServe" else None
    modules = None
    if system == "BanaServe 4-1":
        modules = ModuleMigration(params=module_params or default_module_params(profile))
    if system.startswith("vLLM"):
        engine = replace(profile, prefill_first=system == "vLLM V0")
        simulate(reqs, engine, instances, make_policy("round_robin"), make_queue_policy("fcfs"), max_wait_s=1e9)
    else:
        simulate(
            reqs,
            profile,
            instances - prefill,
            make_policy("least_loaded" if system == "DistServe" else "banaserve"),
            make_queue_policy("fcfs"),
            prefill_instances=prefill,
            max_wait_s=1e9,
            role_switching=switching,
            module_migration=modules,
        )
    done = [r for r in reqs if r.finished_at is not None]
    span = run_span_s(reqs)
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    log = switching or modules
    to = Counter(role for *_, role in log.switched) if log else Counter()
    return Result(
        system,
        len(done) / span,
        sum(r.output_tokens for r in done) / span,
        statistics.fmean(ttfts),
        percentile(ttfts, 0.99),
        statistics.fmean(tpots),
        percentile(tpots, 0.99),
        f"{to['prefill']} to prefill, {to['decode']} to decode" if log else "-",
        len(modules.moved) if modules else 0,
        len(reqs) - len(done),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=ROOT / "sim" / "profiles" / "a100-llama2-13b.json")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=2, help="DistServe's prefill engines (BanaServe's at start)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--lengths", choices=["alpaca", "azure-conv"], default="alpaca")
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 5.0, 10.0, 15.0, 20.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--switch-params",
        type=json.loads,
        default={},
        help="BanaServe's role switching knobs, e.g. '{\"cooldown_s\": 60}'",
    )
    parser.add_argument(
        "--module-params",
        type=json.loads,
        default={},
        help="BanaServe 4-1's knobs (ModuleMigrationParams), e.g. '{\"min_ratio\": 0.2}'; block_s defaults to the "
        "profile's KV transfer",
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--out", type=Path, help="write the tables (markdown) here")
    args = parser.parse_args(argv)
    switch_params = RoleSwitchParams(**args.switch_params)
    if not 0 < args.prefill < args.instances:
        parser.error("--prefill must leave at least one engine of each role")
    profile = load_profile(args.profile)
    module_params = default_module_params(profile, **args.module_params)
    if args.lengths == "alpaca":
        rows = alpaca(args.requests, args.max_output, args.seed)
        lengths = "AlpacaEval instructions with Llama-2-13B-chat's answers (characters / 4)"
    else:
        context = profile.kv_blocks * profile.block_size
        trace = read_trace("azure-conv", args.seed)
        rows = workload(trace, args.requests, 1.0, 1.0, 1.0, min(4096, context), float("inf"), float("inf"))
        rows = [replace(r, output_tokens=min(r.output_tokens, args.max_output)) for r in rows]
        lengths = "the Azure 2023 conversation trace's lengths"
    means = length_means(rows)
    knobs = f", BanaServe's role switching with {args.switch_params}" if args.switch_params else ""
    knobs += f", BanaServe 4-1's knobs {args.module_params}" if args.module_params else ""
    command = command_line("llmesh_sim.banaserve", argv)
    lines = [
        f"Command: `{command}`",
        "",
        f"{args.instances} engines of profile {profile.name}; DistServe and BanaServe (at start) with {args.prefill} "
        f"prefill engines{knobs}; {args.requests} requests of {lengths}, outputs cut at {args.max_output}: mean "
        f"{means[0]:.0f} in, {means[1]:.0f} out (seed {args.seed}); Poisson arrivals. The paper: {PAPER}.",
        "",
        "| req/s | system | throughput req/s | output tok/s | vs vLLM | vs DistServe | TTFT mean s | TTFT P99 s "
        "| TPOT mean ms | TPOT P99 ms | role switches | KV moves | incomplete |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in args.rates:
        requests = arrivals(rows, rate, 1.0, args.seed)
        results = {
            s: run(requests, profile, args.instances, args.prefill, s, switch_params, module_params)
            for s in args.systems
        }

        def ratio(r: Result, baseline: str) -> str:
            return f"{r.tokens_per_s / results[baseline].tokens_per_s:.2f}x" if baseline in results else "-"

        for r in results.values():
            print(f"{rate:g} req/s: {r.system} {r.tokens_per_s:.0f} tok/s", file=sys.stderr)
            lines.append(
                f"| {rate:g} | {r.system} | {r.requests_per_s:.2f} | {r.tokens_per_s:.0f} "
                f"| {ratio(r, 'vLLM')} | {ratio(r, 'DistServe')} | {r.ttft_mean_s:.3f} "
                f"| {r.ttft_p99_s:.3f} | {r.tpot_mean_s * 1e3:.1f} | {r.tpot_p99_s * 1e3:.1f} "
                f"| {r.switches} | {r.kv_moves} | {r.incomplete} |"
            )
    publish("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
