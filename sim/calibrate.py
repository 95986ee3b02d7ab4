"""Fit the simulator's engine model to a real vLLM engine on this machine.

    .venv/bin/python -m llmesh_sim.calibrate [--model llmesh/tiny-llama] [--engines N | --beside KIND] \
        [--out PROFILE.json]

Measures, on one engine configured as the mesh's workers are: the time to first token of a lone
prompt of several lengths (one prefill step each, and the engine's fixed path from a request's
submission to its first token: `EngineProfile.first_token_s`), and the gap between two tokens of B
requests decoding together at two context lengths; then fits `EngineProfile`'s affine step time by
least squares over all of them and reports each measurement against the fit. `--engines N`: N engines
run every measurement at once; `--beside prefill|decode`: one engine is measured while another runs a
prefill worker's prompts or a decode worker's stream back to back (`fidelity --beside-*`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from llmesh.engine.models import resolve_model
from llmesh.wire.config import WorkerSettings

from .engine import EngineProfile, attention_pairs

PREFILL_LENGTHS = (64, 256, 512, 1024, 1536)
DECODE_BATCHES = (1, 4, 16)
DECODE_CONTEXTS = (64, 512)
DECODE_TOKENS = 48
REPEATS = 3


def _prompt(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 1000 + 3 for i in range(n)]  # token ids of the tiny vocab


# what a neighbour engine runs back to back with `--beside`: (prompt tokens, output tokens) of one request
BACKGROUND = {"prefill": (1024, 1), "decode": (64, 256)}


async def measure(
    model: str, settings: WorkerSettings, engines: int = 1, beside: str | None = None
) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]], int]:
    """(prompt tokens, TTFT s) and (batch, context tokens, step s) measurements, and the engine's KV blocks.
    With `engines` > 1, that many engines run every measurement at once, as engines that share this
    machine's cores do in a deployment, and each measurement pools their times. With `beside` (a kind of
    `BACKGROUND`), one engine is measured while a second runs that kind of request back to back."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from llmesh.engine.worker import WARMUP_PROMPT

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))
    args = AsyncEngineArgs(
        model=model,
        dtype=settings.dtype,
        block_size=settings.block_size,
        enforce_eager=True,
        disable_log_stats=True,
        enable_prefix_caching=False,
    )
    if settings.max_model_len:
        args.max_model_len = settings.max_model_len
    started = [AsyncLLM.from_engine_args(args) for _ in range(engines + (beside is not None))]
    measured, neighbour = started[:engines], started[engines:]
    serial = 0

    async def run(engine: AsyncLLM, prompt: list[int], max_tokens: int) -> list[float]:
        nonlocal serial
        serial += 1
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        stamps = [time.perf_counter()]
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=f"c{serial}"):
            stamps.append(time.perf_counter())
        return stamps

    async def everywhere(prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        """The same requests on every measured engine at once; each request's stamps."""
        runs = await asyncio.gather(*[run(e, prompt, max_tokens) for e in measured for prompt in prompts])
        return list(runs)

    async def background(engine: AsyncLLM, kind: str) -> None:
        prompt, output = BACKGROUND[kind]
        for salt in itertools.count():
            await run(engine, _prompt(prompt, 5000 + salt), output)

    await asyncio.gather(*[run(e, WARMUP_PROMPT, 2) for e in started])
    load = [asyncio.create_task(background(e, beside)) for e in neighbour if beside]
    try:
        prefills = []
        for n in PREFILL_LENGTHS:
            ttfts = []
            for rep in range(REPEATS):
                ttfts += [stamps[1] - stamps[0] for stamps in await everywhere([_prompt(n, rep + n)], 1)]
            prefills.append((n, statistics.median(ttfts)))
            print(f"calibrate: prefill {n} tokens: {prefills[-1][1] * 1000:.1f} ms", file=sys.stderr)
        decodes = []
        for context in DECODE_CONTEXTS:
            for batch in DECODE_BATCHES:
                runs = await everywhere([_prompt(context, 1000 + b) for b in range(batch)], DECODE_TOKENS)
                # the steps after every prompt is in: each request's later gaps
                gaps = [
                    b - a
                    for stamps in runs
                    for a, b in zip(stamps[-DECODE_TOKENS // 2 :], stamps[-DECODE_TOKENS // 2 + 1 :])
                ]
                step = statistics.median(gaps)
                decodes.append((batch, batch * (context + DECODE_TOKENS * 3 // 4), step))
                print(
                    f"calibrate: decode batch {batch} at {context}-token prompts: {step * 1000:.2f} ms/step",
                    file=sys.stderr,
                )
        return prefills, decodes, started[0].vllm_config.cache_config.num_gpu_blocks or 0
    finally:
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
        for e in started:
            e.shutdown()


# A measured step: (label, prompt tokens, attention pairs, decoding requests, their context tokens, seconds)
Point = tuple[str, int, int, int, int, float]


def fit_step_time(points: list[Point], first_token: bool = False) -> tuple[list[float], list[float]]:
    """Non-negative least squares on relative error (short steps count as much as long prefills) of
    EngineProfile's step time: (base, per prompt token, per attention pair, per decoding request, per
    context token, first-token overhead), and each point's fitted seconds. `first_token`: the prompt
    points (no decoding request) are times to first token measured from submission, which add the
    engine's fixed path from a request's arrival to its first token leaving (`first_token_s`); without,
    that coefficient is 0. A column whose coefficient comes out negative is dropped (set to 0) and the
    rest refitted."""
    a = np.array(
        [[1.0, n, pairs, b, ctx, float(first_token and n > 0 and b == 0)] for _, n, pairs, b, ctx, _ in points]
    )
    y = np.array([t for *_, t in points])
    w = 1 / y
    keep = list(range(a.shape[1] if first_token else a.shape[1] - 1))
    while True:
        sub, *_ = np.linalg.lstsq(a[:, keep] * w[:, None], y * w, rcond=None)
        if (sub >= 0).all():
            break
        keep.pop(int(np.argmin(sub)))
    coef = np.zeros(a.shape[1])
    coef[keep] = sub
    return [float(c) for c in coef], [float(v) for v in a @ coef]


def fitted_profile(
    name: str, points: list[Point], first_token: bool = False, **limits
) -> tuple[EngineProfile, list[float]]:
    """The profile `fit_step_time` gives `points`, with the engine's `limits` (EngineProfile's other
    fields); and each point's fitted seconds."""
    (base, per_token, per_pair, per_seq, per_ctx, first), fitted = fit_step_time(points, first_token)
    return EngineProfile(
        name,
        base_s=base,
        prefill_token_s=per_token,
        prefill_attention_s=per_pair,
        decode_seq_s=per_seq,
        context_token_s=per_ctx,
        first_token_s=first,
        **limits,
    ), fitted


def write_profile(profile: EngineProfile, report: list[tuple[str, float, float]], path: Path) -> None:
    """Print each (label, measured s, fitted s) and the fit, and save the profile with its worst error."""
    print("| measurement | measured ms | fitted ms | error |\n|---|---|---|---|")
    for what, measured, fitted in report:
        print(f"| {what} | {measured * 1000:.2f} | {fitted * 1000:.2f} | {(fitted - measured) / measured:+.1%} |")
    worst = max(abs(f - m) / m for _, m, f in report)
    print(
        f"\nprofile {profile.name}: step = {profile.base_s * 1000:.3f} ms + {profile.prefill_token_s * 1e6:.2f} µs per "
        f"prompt token + {profile.prefill_attention_s * 1e9:.3f} ns per prompt attention pair + "
        f"{profile.decode_seq_s * 1e6:.2f} µs per decoding request + {profile.context_token_s * 1e9:.2f} ns per "
        f"context token; worst error {worst:.1%}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(profile), "fit_worst_error": worst}, indent=2) + "\n")


def fit(
    name: str,
    prefills: list[tuple[int, float]],
    decodes: list[tuple[int, int, float]],
    kv_blocks: int,
    settings: WorkerSettings,
    source: str,
) -> tuple[EngineProfile, list[tuple[str, float, float]]]:
    """The profile fitted to a lone prompt's times and decode steps' times, and each measurement
    beside its fitted value."""
    points = [(f"prefill {n}", n, attention_pairs(0, n), 0, 0, t) for n, t in prefills]
    points += [(f"decode batch {b}, context {ctx}", 0, 0, b, ctx, t) for b, ctx, t in decodes]
    profile, fitted = fitted_profile(
        name,
        points,
        first_token=True,
        max_batched_tokens=settings.max_model_len,
        max_seqs=settings.capacity,
        kv_blocks=kv_blocks,
        block_size=settings.block_size,
        source=source,
    )
    return profile, [(what, t, f) for (what, *_, t), f in zip(points, fitted)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument("--out", type=Path, default=Path("sim/profiles/cpu-tiny.json"))
    parser.add_argument(
        "--engines", type=int, default=1, help="engines measured at once (those a deployment runs on this machine)"
    )
    parser.add_argument(
        "--beside",
        choices=sorted(BACKGROUND),
        help="measure one engine while a second runs this kind of request back to back (a prefill worker's prompts, "
        "a decode worker's stream): the times a step takes beside such a neighbour",
    )
    args = parser.parse_args(argv)
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    if args.beside and args.engines > 1:
        parser.error("--beside measures one engine: not with --engines")
    settings = WorkerSettings()
    model = resolve_model(args.model, settings.model_dir)
    prefills, decodes, kv_blocks = asyncio.run(measure(model, settings, args.engines, args.beside))
    command = (
        f"python -m llmesh_sim.calibrate --model {args.model}"
        + (f" --engines {args.engines}" if args.engines > 1 else "")
        + (f" --beside {args.beside}" if args.beside else "")
    )
    profile, report = fit(args.out.stem, prefills, decodes, kv_blocks, settings, f"measured here: `{command}`")
    write_profile(profile, report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
