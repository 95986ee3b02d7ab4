"""Run the policies on a real trace in the simulator, at rising load.

    .venv/bin/python -m llmesh_sim --profile sim/profiles/cpu-tiny.json --trace azure-conv \\
        --instances 2 --requests 500 --rates 0.5 1 2 3 --policies least_loaded llumnix --queue-policies fcfs edf

Traces come from ../shared/data: the Azure 2023 conversation and code traces and the Mooncake
conversation trace (real arrivals; Mooncake's prefix block ids let `--prefix-cache` simulate
prefix reuse, per instance as vLLM does or through the mesh's global KV store), and ShareGPT's
request lengths (Poisson arrivals). Each run takes `--requests` consecutive requests, its arrival
gaps rescaled to the rate, its lengths scaled by `--input-scale`/`--output-scale`; the policies
that read predicted lengths get the true one (`--predictions oracle`), the real predictor's
(drawn from its held-out evaluation) or none. Prints a markdown table of TTFT, TPOT, SLO
attainment and goodput per policy pair and rate, and with `--out` writes it and a plot (P99 TTFT,
SLO attainment and goodput against rate).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

from llmesh.policies import POLICIES, QUEUE_POLICIES, make_policy, make_queue_policy

from .cluster import PREFIX_CACHES, Summary, simulate, summarize
from .engine import EngineProfile, SimRequest
from .predictions import HeldOutPredictions, with_predictions

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
TRACES = {
    "azure-conv": DATA / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv",
    "azure-code": DATA / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv",
    "mooncake-conv": DATA / "mooncake-traces" / "conversation_trace.jsonl",
    "sharegpt": DATA / "sharegpt-lengths-sarathi" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
}
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
SLICE = ROOT / "bench" / "data" / "azure_conv_2023_first3000.csv"  # the committed slice, when ../shared is absent


def publish(text: str, out: Path | None) -> None:
    """Print a report, and write it to `out` if given."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def load_profile(path: Path) -> EngineProfile:
    raw = json.loads(path.read_text())
    return EngineProfile(**{f.name: raw[f.name] for f in fields(EngineProfile) if f.name in raw})


TraceRow = tuple[float, int, int, tuple[int, ...]]  # arrival s from the first, prompt and output tokens, block ids


def read_trace(name: str, seed: int = 0) -> list[TraceRow]:
    """Every request of the trace (a trace without arrival times gets Poisson arrivals at 1 req/s)."""
    path = TRACES[name]
    if not path.exists() and name == "azure-conv":
        path = SLICE
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out = [
            (r["timestamp"] / 1000, r["input_length"], r["output_length"], tuple(r.get("hash_ids", ()))) for r in rows
        ]
    else:
        with path.open() as f:
            rows = list(csv.DictReader(f))
        if "TIMESTAMP" in rows[0]:
            out = [
                (
                    datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp(),
                    int(r["ContextTokens"]),
                    int(r["GeneratedTokens"]),
                    (),
                )
                for r in rows
            ]
        else:
            rng, t = random.Random(seed), 0.0
            out = []
            for r in rows:
                out.append((t, int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]), ()))
                t += rng.expovariate(1.0)
    start = out[0][0]
    return [(t - start, p, o, h) for t, p, o, h in out]


def workload(
    trace: list[TraceRow],
    requests: int,
    rate: float,
    input_scale: float,
    output_scale: float,
    max_tokens: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> list[SimRequest]:
    """The first `requests` of `trace` at `rate` (their gaps rescaled), lengths scaled and cut to the
    context; predicted lengths are left to `llmesh_sim.predictions`."""
    rows = trace[:requests]
    gap = (rows[-1][0] - rows[0][0]) / max(len(rows) - 1, 1) or 1.0
    stretch = (1 / rate) / gap
    out = []
    for i, (t, p, o, hashes) in enumerate(rows):
        output = max(1, min(round(o * output_scale), max_tokens // 4))  # a long prompt keeps room to answer
        prompt = max(1, min(round(p * input_scale), max_tokens - output))
        blocks = -(-prompt // MOONCAKE_BLOCK_TOKENS) if input_scale == 1 else 0  # block ids hold for unscaled prompts
        out.append(
            SimRequest(
                f"r{i}",
                (t - rows[0][0]) * stretch,
                prompt,
                output,
                ttft_slo_s=ttft_slo_s,
                tpot_slo_s=tpot_slo_s,
                prefix_hashes=tuple(hashes[:blocks]),
            )
        )
    return out


def arrivals(rows: list[SimRequest], rate: float, cv: float, seed: int) -> list[SimRequest]:
    """`rows` re-timed: Gamma inter-arrival gaps of mean 1/`rate` and coefficient of variation `cv`."""
    rng, t, out = random.Random(seed), 0.0, []
    shape = 1 / cv**2
    for r in rows:
        out.append(replace(r, arrival=t))
        t += rng.gammavariate(shape, 1 / (rate * shape))
    return out


def length_means(rows: Sequence[SimRequest]) -> tuple[float, float]:
    """The requests' mean prompt and output tokens."""
    return statistics.fmean(r.prompt_tokens for r in rows), statistics.fmean(r.output_tokens for r in rows)


def command_line(module: str, argv: list[str] | None) -> str:
    """How a report's command was run: `python -m <module>` and its arguments."""
    return f"python -m {module} {' '.join(argv if argv is not None else sys.argv[1:])}"


PREDICTIONS = ("oracle", "real", "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True, help="an EngineProfile JSON (llmesh_sim.calibrate)")
    parser.add_argument("--trace", choices=sorted(TRACES), default="azure-conv")
    parser.add_argument("--instances", type=int, default=2, help="engines (decode engines with --prefill-instances)")
    parser.add_argument(
        "--prefill-instances",
        type=int,
        default=0,
        help="a prefill pool before the decode engines (0: monolithic engines)",
    )
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 3])
    parser.add_argument("--policies", nargs="+", default=sorted(POLICIES), choices=sorted(POLICIES))
    parser.add_argument("--queue-policies", nargs="+", default=["fcfs"], choices=sorted(QUEUE_POLICIES))
    parser.add_argument(
        "--policy-params",
        type=json.loads,
        default={},
        help='JSON: {"policy": {"param": value}}, as MESH_POLICY_PARAMS for each named policy',
    )
    parser.add_argument(
        "--predictions",
        nargs="+",
        default=["oracle"],
        choices=PREDICTIONS,
        help="what length-reading policies get: the true length, the real predictor's (from its "
        "held-out evaluation), or nothing",
    )
    parser.add_argument(
        "--prefix-cache",
        choices=PREFIX_CACHES,
        default="none",
        help="prefix reuse (traces with block ids): per instance (vLLM) or the global KV store",
    )
    parser.add_argument(
        "--store-blocks", type=int, default=1 << 20, help="the global store's capacity, in trace blocks"
    )
    parser.add_argument(
        "--local-prefill-margin-s",
        type=float,
        default=None,
        help="conditional disaggregation as the router's MESH_LOCAL_PREFILL_MARGIN_S (unset: off)",
    )
    parser.add_argument("--input-scale", type=float, default=1.0)
    parser.add_argument("--output-scale", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000)
    parser.add_argument("--tpot-slo-ms", type=float, default=50)
    parser.add_argument("--max-wait-s", type=float, default=30.0, help="the router's MESH_QUEUE_MAX_WAIT_S")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write sim.md, sim.json (and sim.png with matplotlib) here")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    trace = read_trace(args.trace, args.seed)
    heldout = HeldOutPredictions.load() if "real" in args.predictions else None
    runs = [
        (p, q, m, r) for p in args.policies for q in args.queue_policies for m in args.predictions for r in args.rates
    ]
    results: list[Point] = []
    for policy, queue_policy, predictions, rate in tqdm(runs, desc="sim", unit="point", file=sys.stderr):
        reqs = workload(
            trace,
            args.requests,
            rate,
            args.input_scale,
            args.output_scale,
            args.max_model_len,
            args.ttft_slo_ms / 1000,
            args.tpot_slo_ms / 1000,
        )
        with_predictions(reqs, predictions, args.seed, heldout)
        done = simulate(
            reqs,
            profile,
            args.instances,
            make_policy(policy, args.policy_params.get(policy)),
            make_queue_policy(queue_policy, args.policy_params.get(queue_policy)),
            seed=args.seed,
            prefill_instances=args.prefill_instances,
            local_prefill_margin_s=args.local_prefill_margin_s,
            tpot_slo_s=args.tpot_slo_ms / 1000,
            prefix_cache=args.prefix_cache,
            store_blocks=args.store_blocks,
            max_wait_s=args.max_wait_s,
        )
        results.append(
            Point(
                policy,
                queue_policy,
                predictions,
                rate,
                summarize(done, args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000),
            )
        )
    command = command_line("llmesh_sim", argv)
    table = report(results, command, profile, args)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sim.md").write_text(table)
        (args.out / "sim.json").write_text(
            json.dumps(
                {
                    "command": command,
                    "points": [
                        {
                            "policy": p.policy,
                            "queue": p.queue,
                            "predictions": p.predictions,
                            "rate": p.rate,
                            **asdict(p.summary),
                        }
                        for p in results
                    ],
                },
                indent=1,
            )
            + "\n"
        )
        _plot(results, args.out / "sim.png")
    return 0


@dataclass(frozen=True)
class Point:
    policy: str
    queue: str
    predictions: str
    rate: float
    summary: Summary

    @property
    def label(self) -> str:
        return f"{self.policy} + {self.queue}" + ("" if self.predictions == "oracle" else f" ({self.predictions})")


def highest_rate(points: list[Point], attainment: float) -> float | None:
    """The highest rate up to which every swept rate reached `attainment` (None: not even the lowest)."""
    best = None
    for p in sorted(points, key=lambda p: p.rate):
        if p.summary.slo_attainment < attainment:
            break
        best = p.rate
    return best


def report(results: list[Point], command: str, profile: EngineProfile, args: argparse.Namespace) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Profile {profile.name} ({profile.source or 'no source given'}), "
        f"{f'{args.prefill_instances} prefill + ' if args.prefill_instances else ''}{args.instances} instances, trace "
        f"{args.trace}, {args.requests} requests per point, prefix cache {args.prefix_cache}, SLO: TTFT ≤ "
        f"{args.ttft_slo_ms:g} ms, TPOT ≤ {args.tpot_slo_ms:g} ms.",
        "",
        "| policy | queue | predictions | req/s | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms | TPOT P99 ms | "
        "SLO attained | goodput req/s | refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in results:
        s = p.summary
        lines.append(
            f"| {p.policy} | {p.queue} | {p.predictions} | {p.rate:g} | {s.ttft_p50_s * 1000:.0f} | "
            f"{s.ttft_p99_s * 1000:.0f} | {s.tpot_p50_s * 1000:.1f} | {s.tpot_p99_s * 1000:.1f} | "
            f"{s.slo_attainment:.1%} | {s.goodput_rps:.2f} | {s.refused} |"
        )
    lines += [
        "",
        "Highest swept rate up to which SLO attainment held:",
        "",
        "| policy | queue | predictions | ≥ 90% | ≥ 99% |",
        "|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((p.policy, p.queue, p.predictions) for p in results):
        points = [p for p in results if (p.policy, p.queue, p.predictions) == key]
        cells = [
            f"{r:g} req/s" if r is not None else "none" for r in (highest_rate(points, 0.9), highest_rate(points, 0.99))
        ]
        lines.append(f"| {' | '.join(key)} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _plot(results: list[Point], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sim: matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (ttft, attained, good) = plt.subplots(1, 3, figsize=(15, 4))
    for label in dict.fromkeys(p.label for p in results):
        points = sorted((p for p in results if p.label == label), key=lambda p: p.rate)
        rates = [p.rate for p in points]
        ttft.plot(rates, [p.summary.ttft_p99_s * 1000 for p in points], marker="o", label=label)
        attained.plot(rates, [p.summary.slo_attainment * 100 for p in points], marker="o", label=label)
        good.plot(rates, [p.summary.goodput_rps for p in points], marker="o", label=label)
    ttft.set(xlabel="req/s", ylabel="P99 TTFT (ms)", yscale="log")
    attained.set(xlabel="req/s", ylabel="SLO attainment (%)")
    good.set(xlabel="req/s", ylabel="goodput (req/s)")
    good.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
