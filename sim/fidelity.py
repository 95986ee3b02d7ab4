"""The simulator against a real run: the same requests, the same arrival times.

    .venv/bin/python -m llmesh_sim.fidelity --results docs/serve/results.json --profile sim/profiles/cpu-tiny.json \
        [--shared-profile PROFILE.json | --beside-prefill PROFILE.json --beside-decode PROFILE.json] [--path]

Takes every point of a `bench/serve.py` run (its results.json keeps each request's start,
prompt and output tokens and TTFT), replays those requests in the simulator as the deployment
was built (the mesh: one prefill and one decode engine with the router's conditional
disaggregation; vllm-router: two engines, power of two choices; plain vLLM: one engine) and
prints the measured and simulated P50 and P99 TTFT side by side (goal: within 20%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from llmesh.policies import make_policy, make_queue_policy

from .__main__ import load_profile
from .cluster import percentile, simulate
from .engine import STEP_KINDS, EngineProfile, SimRequest

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


def path_costs(probes: list[dict], profile: EngineProfile) -> dict[str, list[tuple[int, float]]]:
    """Each deployment's request path in ms by prompt length: at each probed length, its probes' median TTFT
    less `profile`'s time to first token for that prompt on an idle engine."""
    ttfts: dict[tuple[str, int], list[float]] = {}
    for probe in probes:
        ttfts.setdefault((probe["deployment"], probe["prompt_tokens"]), []).extend(probe["ttft_ms"])
    out: dict[str, list[tuple[int, float]]] = {}
    for (deployment, tokens), ms in sorted(ttfts.items()):
        modelled = (profile.prefill_s(tokens) + profile.first_token_s) * 1000
        out.setdefault(deployment, []).append((tokens, statistics.median(ms) - modelled))
    return out


def path_at(points: list[tuple[int, float]], tokens: int) -> float:
    """The path (ms) for a prompt of `tokens`: the line through the first and last probed lengths (their one
    value if one length), at least 0."""
    (n0, ms0), (n1, ms1) = points[0], points[-1]
    slope = (ms1 - ms0) / (n1 - n0) if n1 != n0 else 0.0
    return max(ms0 + slope * (tokens - n0), 0.0)


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
    parser.add_argument(
        "--path",
        action="store_true",
        help="add each deployment's request path to every simulated TTFT: its lone probes' median TTFT "
        "(`bench/serve.py --path-probes`) less the profile's time for their prompt, linear in the prompt's length",
    )
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    beside = {k: load_profile(path) for k in STEP_KINDS if (path := getattr(args, f"beside_{k}"))}
    if args.shared_profile and beside:
        parser.error("--shared-profile or --beside-*, not both")
    shared = dict.fromkeys(STEP_KINDS, load_profile(args.shared_profile)) if args.shared_profile else beside or None
    results = json.loads(args.results.read_text())
    points = [p for p in results["points"] if p.get("requests", {}).get("start_s")]
    path_ms = path_costs(results.get("path_probes", []), profile) if args.path else {}
    if args.path and not path_ms:
        parser.error(f"{args.results} has no path probes (bench/serve.py --path-probes N)")
    for deployment, by_length in sorted(path_ms.items()):
        shown = ", ".join(f"{ms:.1f} ms at {tokens} tokens" for tokens, ms in by_length)
        print(f"{deployment}'s request path: {shown}, added to each simulated TTFT (linear in the prompt)")
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
        path = path_ms.get(point["deployment"])
        sim = [
            r.ttft_s * 1000 + (path_at(path, r.prompt_tokens) if path else 0.0) for r in done if r.ttft_s is not None
        ]
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
