"""Run the policies on a real trace in the simulator, at rising load.

    .venv/bin/python -m llmesh_sim --profile sim/profiles/cpu-tiny.json --trace azure-conv \\
        --instances 2 --requests 500 --rates 0.5 1 2 3 --policies least_loaded llumnix --queue-policies fcfs edf

Traces come from ../shared/data (the Azure 2023 conversation and code traces, the Mooncake
conversation trace); each run takes `--requests` consecutive requests, its arrival gaps rescaled
to the rate, its lengths scaled by `--input-scale`/`--output-scale`. Prints a markdown table of
TTFT, TPOT, SLO attainment and goodput per policy pair and rate, and with `--out` writes it and
a plot (P99 TTFT and goodput against rate).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import fields
from datetime import datetime
from pathlib import Path

from llmesh.policies import POLICIES, QUEUE_POLICIES, make_policy, make_queue_policy

from .cluster import Summary, simulate, summarize
from .engine import EngineProfile, SimRequest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
TRACES = {
    "azure-conv": DATA / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv",
    "azure-code": DATA / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv",
    "mooncake-conv": DATA / "mooncake-traces" / "conversation_trace.jsonl",
}
SLICE = ROOT / "bench" / "data" / "azure_conv_2023_first3000.csv"  # the committed slice, when ../shared is absent


def load_profile(path: Path) -> EngineProfile:
    raw = json.loads(path.read_text())
    return EngineProfile(**{f.name: raw[f.name] for f in fields(EngineProfile) if f.name in raw})


def read_trace(name: str) -> list[tuple[float, int, int]]:
    """(arrival s from the first, prompt tokens, output tokens) of every request of the trace."""
    path = TRACES[name]
    if not path.exists() and name == "azure-conv":
        path = SLICE
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out = [(r["timestamp"] / 1000, r["input_length"], r["output_length"]) for r in rows]
    else:
        with path.open() as f:
            out = [(datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp(), int(r["ContextTokens"]),
                    int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    start = out[0][0]
    return [(t - start, p, o) for t, p, o in out]


def workload(trace: list[tuple[float, int, int]], requests: int, rate: float, input_scale: float,
             output_scale: float, max_tokens: int, ttft_slo_s: float, tpot_slo_s: float) -> list[SimRequest]:
    rows = trace[:requests]
    gap = (rows[-1][0] - rows[0][0]) / max(len(rows) - 1, 1) or 1.0
    stretch = (1 / rate) / gap
    out = []
    for i, (t, p, o) in enumerate(rows):
        prompt = max(1, min(round(p * input_scale), max_tokens - 1))
        output = max(1, min(round(o * output_scale), max_tokens - prompt))
        out.append(SimRequest(f"r{i}", (t - rows[0][0]) * stretch, prompt, output, ttft_slo_s=ttft_slo_s,
                              tpot_slo_s=tpot_slo_s, predicted_tokens=float(output)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True, help="an EngineProfile JSON (llmesh_sim.calibrate)")
    parser.add_argument("--trace", choices=sorted(TRACES), default="azure-conv")
    parser.add_argument("--instances", type=int, default=2, help="engines (decode engines with --prefill-instances)")
    parser.add_argument("--prefill-instances", type=int, default=0, help="a prefill pool before the decode engines "
                        "(0: monolithic engines)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 3])
    parser.add_argument("--policies", nargs="+", default=sorted(POLICIES), choices=sorted(POLICIES))
    parser.add_argument("--queue-policies", nargs="+", default=["fcfs"], choices=sorted(QUEUE_POLICIES))
    parser.add_argument("--local-prefill-margin-s", type=float, default=None,
                        help="conditional disaggregation as the router's MESH_LOCAL_PREFILL_MARGIN_S (unset: off)")
    parser.add_argument("--input-scale", type=float, default=1.0)
    parser.add_argument("--output-scale", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000)
    parser.add_argument("--tpot-slo-ms", type=float, default=50)
    parser.add_argument("--out", type=Path, help="write sim.md (and sim.png with matplotlib) here")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    trace = read_trace(args.trace)
    runs = [(p, q, r) for p in args.policies for q in args.queue_policies for r in args.rates]
    results: list[tuple[str, str, float, Summary]] = []
    for i, (policy, queue_policy, rate) in enumerate(runs, 1):
        reqs = workload(trace, args.requests, rate, args.input_scale, args.output_scale, args.max_model_len,
                        args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
        done = simulate(reqs, profile, args.instances, make_policy(policy), make_queue_policy(queue_policy),
                        prefill_instances=args.prefill_instances, local_prefill_margin_s=args.local_prefill_margin_s,
                        tpot_slo_s=args.tpot_slo_ms / 1000)
        results.append((policy, queue_policy, rate, summarize(done, args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)))
        print(f"sim: [{i}/{len(runs)}] {policy} + {queue_policy} at {rate:g} req/s", file=sys.stderr)
    lines = [f"Command: `python -m llmesh_sim {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"Profile {profile.name} ({profile.source or 'no source given'}), "
             f"{f'{args.prefill_instances} prefill + ' if args.prefill_instances else ''}{args.instances} instances, trace "
             f"{args.trace}, {args.requests} requests per point, SLO: TTFT ≤ {args.ttft_slo_ms:g} ms, TPOT ≤ "
             f"{args.tpot_slo_ms:g} ms.", "",
             "| policy | queue | req/s | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms | TPOT P99 ms | SLO attained | "
             "goodput req/s | refused |", "|---|---|---|---|---|---|---|---|---|---|"]
    for policy, queue_policy, rate, s in results:
        lines.append(f"| {policy} | {queue_policy} | {rate:g} | {s.ttft_p50_s * 1000:.0f} | {s.ttft_p99_s * 1000:.0f} | "
                     f"{s.tpot_p50_s * 1000:.1f} | {s.tpot_p99_s * 1000:.1f} | {s.slo_attainment:.1%} | "
                     f"{s.goodput_rps:.2f} | {s.refused} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sim.md").write_text(table)
        _plot(results, args.out / "sim.png")
    return 0


def _plot(results: list[tuple[str, str, float, Summary]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sim: matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (ttft, good) = plt.subplots(1, 2, figsize=(11, 4))
    for key in dict.fromkeys((p, q) for p, q, _, _ in results):
        points = [(rate, s) for p, q, rate, s in results if (p, q) == key]
        label = " + ".join(key)
        ttft.plot([r for r, _ in points], [s.ttft_p99_s * 1000 for _, s in points], marker="o", label=label)
        good.plot([r for r, _ in points], [s.goodput_rps for _, s in points], marker="o", label=label)
    ttft.set(xlabel="req/s", ylabel="P99 TTFT (ms)", yscale="log")
    good.set(xlabel="req/s", ylabel="goodput (req/s)")
    good.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
