"""The length predictor's head per served model, on real answers: the shared head against each
model's own head after the service's automatic refits, against the constant.

    .venv/bin/python bench/length_per_model.py [--source alpaca-eval] [--model-a Meta-Llama-3]
        [--model-b claude] [--refit-every 200] [--test-fraction 0.3] [--test-seed 1] [--artifact DIR]

Two served models, each the answers of one generator family in `--source` (generators whose name
matches the pattern): by default the Llama 3 and 3.1 instruct models, 8B and 70B (verbose), and
Claude 3 Opus and 3.5 Sonnet. The artifact is trained (`llmesh_lengthpred.train`, as the committed
one) on every other source, so the prompts' source is one it has not seen, and the generator is
not given (MESH_LENGTH_GENERATOR unset: a mesh serving several models has no one name for it).
Each model's answers are split by prompt: the replayed part goes through a running service (its
own process's nats-server and Redis), each answer as a prediction asked with the model's name and
the worker's LengthObserved report, so the service refits that model's head itself every
`--refit-every` of its samples (the same gated refit as `llmesh_lengthpred.refit --model`); the
rest is the test, never observed. On the test answers: the shared head (a model without a head of
its own), the model's head once the replay is done, and the constant (the median of the model's
replayed answers): MAE, the median of predicted / actual, ±1 bucket.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from llmesh.deploy.launcher import start_nats, start_redis
from llmesh.wire.bus import Bus
from llmesh.wire.lengths import bucket_of, cut_prompt
from llmesh.wire.messages import (
    LengthObserved,
    LengthPrediction,
    LengthPredictRequest,
    LengthStats,
    LengthStatsRequest,
    Subjects,
)
from llmesh_lengthpred import data, train
from llmesh_lengthpred.model import load_tokenizer
from llmesh_lengthpred.predictor import REFIT_SEED
from llmesh_lengthpred.service import LengthPredictorService
from llmesh_lengthpred.settings import LengthPredictorSettings

SEED = 0  # the artifact's training, and the replay's order
TEST_SEED = 1  # the test split's default; not REFIT_SEED (the refit's split: it would find no held-out part)
CONCURRENCY = 32


def artifact_without(source: str, directory: Path) -> Path:
    """A length model trained as the committed one, on every source but `source` (reused if there)."""
    if not (directory / "total.npz").exists():
        started = time.monotonic()
        others = tuple(s for s in data.SOURCES if s != source)
        train.run(seed=SEED, out=directory, quiet=True, sources=others, leave_one_out=False)
        print(f"trained on {', '.join(others)} in {time.monotonic() - started:.0f} s: {directory}")
    return directory


def answers_of(examples: list[data.Example], pattern: str) -> list[data.Example]:
    chosen = [e for e in examples if re.search(pattern, e.generator, re.IGNORECASE)]
    if not chosen:
        raise SystemExit(f"no generator matches {pattern!r}")
    return chosen


async def predict(bus: Bus, model: str, prompt: str, request_id: str = "") -> LengthPrediction:
    text, chars = cut_prompt(prompt)
    reply, _ = await bus.request(
        Subjects.LENGTH_PREDICT,
        LengthPredictRequest(request_id=request_id, prompt=text, prompt_chars=chars, model=model),
        LengthPrediction,
        timeout=30,
    )
    return reply


async def replay(bus: Bus, model: str, answers: list[data.Example]) -> None:
    """Each answer as a served request: predicted, then reported by the worker."""
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, answer: data.Example) -> None:
        async with limit:
            request_id = f"{model}-{i}"
            predicted = await predict(bus, model, answer.prompt, request_id)
            report = LengthObserved(
                request_id=request_id,
                predicted=predicted,
                actual_tokens=answer.output_tokens,
                finish_reason="stop",
                model=model,
            )
            await bus.publish(Subjects.length_observed(predicted.replica), report)

    await asyncio.gather(*(one(i, a) for i, a in enumerate(answers)))


def scores(expected: np.ndarray, actual: np.ndarray) -> dict[str, float]:
    within_one = np.abs(np.array([bucket_of(round(e)) - bucket_of(int(a)) for e, a in zip(expected, actual)])) <= 1
    return {
        "mae": float(np.abs(expected - actual).mean()),
        "ratio": float(np.median(expected / np.maximum(actual, 1))),
        "within_one": float(within_one.mean()),
    }


async def run(args: argparse.Namespace) -> list[dict]:
    tokenizer = load_tokenizer()
    examples = data.load(train.token_counter(tokenizer), (args.source,))
    models = {"A": answers_of(examples, args.model_a), "B": answers_of(examples, args.model_b)}
    artifact = artifact_without(args.source, args.artifact)
    workdir = Path(tempfile.mkdtemp(prefix="length-per-model-"))
    nats, nats_url = start_nats(workdir, log_path=workdir / "nats.log")
    redis, redis_url = start_redis(log_path=workdir / "redis.log")
    settings = LengthPredictorSettings(
        _env_file=None,
        redis_url=redis_url,
        length_artifact_dir=artifact,
        length_generator="",
        length_refit_every=args.refit_every,
        length_recent_samples=args.recent_samples,
    )
    service_bus, bus = await Bus.connect(nats_url, "length-bench-service"), await Bus.connect(nats_url, "bench")
    service = await LengthPredictorService.create(service_bus, settings, "length-bench")
    rows = []
    try:
        await service.start()
        for name, answers in models.items():
            model = f"model-{name}"
            observed, test = data.split_by_prompt(answers, args.test_fraction, args.test_seed)
            order = np.random.default_rng(SEED).permutation(len(observed))
            observed = [observed[i] for i in order]  # arrivals in no particular order
            shared = [await predict(bus, "", e.prompt) for e in test]
            started = time.monotonic()
            await replay(bus, model, observed)
            while True:  # every report in, every refit done
                stats, _ = await bus.request(
                    Subjects.length_stats(service.replica), LengthStatsRequest(), LengthStats, timeout=30
                )
                if stats.samples >= sum(len(r["observed"]) for r in rows) + len(observed) and not service._auto_refits:
                    break
                await asyncio.sleep(0.2)
            replay_s = time.monotonic() - started
            own = [await predict(bus, model, e.prompt) for e in test]
            actual = np.array([e.output_tokens for e in test], dtype=float)
            median = float(np.median([e.output_tokens for e in observed]))
            refits = {o: service.refits.labels(o, model)._value.get() for o in ("accepted", "rejected", "skipped")}
            rows.append(
                {
                    "model": name,
                    "generators": sorted({e.generator for e in answers}),
                    "observed": observed,
                    "test": len(test),
                    "refits": refits,
                    "replay_s": replay_s,
                    "shared": scores(np.array([p.expected_tokens for p in shared]), actual),
                    "own": scores(np.array([p.expected_tokens for p in own]), actual),
                    "constant": scores(np.full(len(test), median), actual),
                    "head": stats.heads.get(model, "none (the shared head)"),
                    "informative": own[0].informative,
                }
            )
    finally:
        await bus.close()
        await service_bus.close()
        await service.close()
        redis.stop()
        nats.stop()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model (generators) | replayed / test answers | automatic refits accepted / rejected / skipped "
        "| predictor on the test answers | MAE tokens | median predicted / actual | ±1 bucket |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        refits = "{accepted:.0f} / {rejected:.0f} / {skipped:.0f}".format(**r["refits"])
        for i, (label, key) in enumerate(
            [("shared head", "shared"), ("the model's own head", "own"), ("constant (replayed median)", "constant")]
        ):
            s = r[key]
            first = (
                [f"{r['model']} ({', '.join(r['generators'])})", f"{len(r['observed'])} / {r['test']}", refits]
                if i == 0
                else ["", "", ""]
            )
            lines.append(
                "| "
                + " | ".join(first + [label, f"{s['mae']:.0f}", f"{s['ratio']:.2f}", f"{s['within_one']:.1%}"])
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="alpaca-eval", choices=data.SOURCES)
    parser.add_argument("--model-a", default=r"^Meta-Llama-3", help="model A: generators matching this pattern")
    parser.add_argument("--model-b", default=r"^claude", help="model B: generators matching this pattern")
    defaults = LengthPredictorSettings.model_fields
    parser.add_argument("--refit-every", type=int, default=defaults["length_refit_every"].default)
    parser.add_argument("--recent-samples", type=int, default=defaults["length_recent_samples"].default)
    parser.add_argument("--test-fraction", type=float, default=0.3)
    parser.add_argument(
        "--test-seed", type=int, default=TEST_SEED, help="the test split's seed (another seed: another split by prompt)"
    )
    parser.add_argument(
        "--artifact",
        type=Path,
        default=Path(tempfile.gettempdir()) / "llmesh-length-artifact-without-{source}",
        help="where the artifact trained without --source is kept ({source} is replaced)",
    )
    args = parser.parse_args()
    if args.test_seed == REFIT_SEED:
        parser.error(f"--test-seed {REFIT_SEED} is the refit's own split: its replayed part would hold nothing out")
    args.artifact = Path(str(args.artifact).format(source=args.source))
    started = time.monotonic()
    rows = asyncio.run(run(args))
    for r in rows:
        print(
            f"model {r['model']}: head {r['head']} (informative: {r['informative']}), "
            f"replay and refits {r['replay_s']:.0f} s"
        )
    print(table(rows))
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
