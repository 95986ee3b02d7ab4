"""The simulator against a real run: the same requests, the same arrival times.

    .venv/bin/python -m llmesh_sim.fidelity --results docs/serve/results.json --profile sim/profiles/cpu-tiny.json \
        [--shared-profile PROFILE.json | --beside-prefill PROFILE.json --beside-decode PROFILE.json]

Takes every point of a `bench/serve.py` run (its results.json keeps each request's start,
prompt and output tokens and TTFT), replays those requests in the simulator as the deployment
was built (the mesh: one prefill and one decode engine with the router's conditional
disaggregation; vllm-router: two engines, power of two choices; plain vLLM: one engine) and
prints the measured and simulated P50 and P99 TTFT side by side (goal: within 20%).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmesh.policies import make_policy, make_queue_policy

from .__main__ import load_profile
from .cluster import percentile, simulate
from .engine import STEP_KINDS, SimRequest

# deployment -> (decode or monolithic engines, prefill engines, dispatch policy, conditional disaggregation margin)
DEPLOYMENTS = {
    "mesh": (1, 1, "least_loaded", 0.25),
    "vllm-router": (2, 0, "power_of_two", None),
    "vllm": (1, 0, "least_loaded", None),
}


def replay(point: dict) -> list[SimRequest]:
    r = point["requests"]
    return [
        SimRequest(f"r{i}", start, prompt, output)
        for i, (start, prompt, output) in enumerate(zip(r["start_s"], r["prompt_tokens"], r["output_tokens"]))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--tpot-slo-ms", type=float, default=50)
    parser.add_argument(
        "--shared-profile",
        type=Path,
        help="the engines' times while another runs at once (`llmesh_sim.calibrate --engines 2`): the deployment's "
        "engines share this machine's cores (default: each has them alone)",
    )
    for kind in STEP_KINDS:
        parser.add_argument(
            f"--beside-{kind}",
            type=Path,
            help=f"an engine's times beside one that {'computes prompts' if kind == 'prefill' else 'decodes'} "
            f"(`llmesh_sim.calibrate --beside {kind}`): a step that starts while another engine's step of that "
            "kind is in progress takes them",
        )
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    beside = {k: load_profile(path) for k in STEP_KINDS if (path := getattr(args, f"beside_{k}"))}
    if args.shared_profile and beside:
        parser.error("--shared-profile or --beside-*, not both")
    shared = dict.fromkeys(STEP_KINDS, load_profile(args.shared_profile)) if args.shared_profile else beside or None
    points = [p for p in json.loads(args.results.read_text())["points"] if p.get("requests", {}).get("start_s")]
    print(
        "| deployment | workload | req/s | requests | P50 TTFT real ms | sim ms | ratio | P99 TTFT real ms | sim ms "
        "| ratio |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for point in points:
        engines, prefill, policy, margin = DEPLOYMENTS[point["deployment"]]
        done = simulate(
            replay(point),
            profile,
            engines,
            make_policy(policy),
            make_queue_policy("fcfs"),
            prefill_instances=prefill,
            local_prefill_margin_s=margin,
            tpot_slo_s=args.tpot_slo_ms / 1000,
            shared_profiles=shared,
        )
        real = [t for t in point["requests"]["ttft_ms"] if t is not None]
        sim = [r.ttft_s * 1000 for r in done if r.ttft_s is not None]
        cells = []
        for q in (0.5, 0.99):
            measured, simulated = percentile(real, q), percentile(sim, q)
            cells += [f"{measured:.0f}", f"{simulated:.0f}", f"{simulated / measured:.2f}"]
        print(
            f"| {point['deployment']} | {point['workload']} | {point['rate']:g} | {len(real)} | "
            + " | ".join(cells)
            + " |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
