"""Train the length models on every source, evaluate them on sources they did not see, and write
the artifact the service loads.

    .venv/bin/python -m llmesh_lengthpred.train [--out DIR] [--limit-prompts N] [--seed 0]

Prints, for each source held out in turn (leave-one-source-out: trained on the others, tested on
it) and for a split by prompt across all of them: exact and ±1-bucket accuracy, the mean absolute
error of the expected length in tokens, Kendall's tau and Spearman's rho between predicted and
actual lengths, and the same for the constant (the training median) trained on the same data;
then the remaining-length model's error by the number of tokens already generated, against the
prompt-only model's on the same requests. The artifact is trained on everything.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from llmesh.wire.lengths import MAX_GENERATED_CHARS, bucket_of

from . import data
from .model import load_tokenizer
from .regression import RemainingModel, Ridge, TotalModel, bucket_probs

# ridge penalties; tried 1, 3, 10 and 30 (docs/benchmarks.md): 30 keeps the prompt-only model's MAE under the
# constant's on every held-out source, at 0.01 of tau within the sources it was trained on
TOTAL_ALPHA = 30.0
REMAINING_ALPHA = 10.0
SIGMA_FRACTION = 0.1  # of the training prompts, held back to measure the residual spread
SEEN = (16, 32, 64, 128, 256, 512)  # generated tokens at which the remaining-length model is trained and scored


@dataclass
class Scores:
    name: str
    rows: int
    exact: float
    within_one: float
    mae_tokens: float
    kendall_tau: float | None  # over all held-out responses, whoever generated them
    kendall_tau_per_generator: float | None  # within each generator's responses (a deployment serves one
    spearman: float | None  # model), averaged weighted by their count


def score(
    name: str, predicted_tokens: np.ndarray, buckets: np.ndarray, actual: np.ndarray, generators: list[str]
) -> Scores:
    truth = np.array([bucket_of(int(n)) for n in actual])

    def varies(*arrays: np.ndarray) -> bool:  # a rank correlation with a constant is undefined
        return all(len(set(a.tolist())) > 1 for a in arrays)

    ranked = varies(predicted_tokens, actual)
    per_generator = []
    for g in set(generators):
        rows = np.array([x == g for x in generators])
        if rows.sum() >= 20 and varies(predicted_tokens[rows], actual[rows]):
            per_generator.append((rows.sum(), stats.kendalltau(predicted_tokens[rows], actual[rows]).statistic))
    return Scores(
        name,
        len(actual),
        float((buckets == truth).mean()),
        float((abs(buckets - truth) <= 1).mean()),
        float(np.abs(predicted_tokens - actual).mean()),
        float(stats.kendalltau(predicted_tokens, actual).statistic) if ranked else None,
        float(sum(n * t for n, t in per_generator) / sum(n for n, _ in per_generator)) if per_generator else None,
        float(stats.spearmanr(predicted_tokens, actual).statistic) if ranked else None,
    )


def token_counter(tokenizer):
    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    return count


@dataclass
class Prefix:
    """A response cut after `seen` tokens, as the remaining-length model is asked about it."""

    example: data.Example
    seen: int
    text: str

    @property
    def remaining(self) -> int:
        return self.example.output_tokens - self.seen


def prefixes(tokenizer, examples: list[data.Example], seen: tuple[int, ...] = SEEN) -> list[Prefix]:
    """Each response cut at each of `seen` tokens it runs past."""
    out = []
    long_enough = [e for e in examples if e.output_tokens > min(seen)]
    for start in range(0, len(long_enough), 256):
        chunk = long_enough[start : start + 256]
        offsets = tokenizer([e.response for e in chunk], add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
        for e, spans in zip(chunk, offsets):
            out += [Prefix(e, k, e.response[: spans[k - 1][1]][-MAX_GENERATED_CHARS:]) for k in seen if len(spans) > k]
    return out


class Featurized:
    """Every example's and every prefix's features, computed once, sliced by split."""

    def __init__(self, examples: list[data.Example], prefixes: list[Prefix]):
        self.examples, self.prefixes = examples, prefixes
        self.total = TotalModel()
        self.remaining = RemainingModel(hasher=self.total.hasher)
        self.x, self.dense = self.total.features([e.prompt for e in examples], [e.generator for e in examples])
        self.y = np.log1p([e.output_tokens for e in examples])
        self.px, self.pdense = self.remaining.features(
            [p.example.prompt for p in prefixes], [p.text for p in prefixes], [p.seen for p in prefixes]
        )
        self.py = np.log1p([p.remaining for p in prefixes])
        self._index = {id(e): i for i, e in enumerate(examples)}
        self.prefix_example = np.array([self._index[id(p.example)] for p in prefixes], dtype=int)

    def rows(self, chosen: list[data.Example]) -> np.ndarray:
        return np.array([self._index[id(e)] for e in chosen], dtype=int)


def _sigma_split(f: Featurized, rows: np.ndarray, seed: int) -> np.ndarray:
    """Which of `rows` are held back to measure the residual spread (by prompt; another seed than
    the evaluation's split, whose training side it would otherwise leave empty)."""
    held = {e.prompt for e in data.split_by_prompt([f.examples[i] for i in rows], SIGMA_FRACTION, seed + 1)[1]}
    return np.array([f.examples[i].prompt in held for i in rows])


def fit_total(f: Featurized, rows: np.ndarray, seed: int) -> Ridge:
    held = _sigma_split(f, rows, seed)
    fit, out = rows[~held], rows[held]
    ridge = Ridge.fit(f.x[fit], f.dense[fit], f.y[fit], TOTAL_ALPHA)
    ridge.sigma = float(np.std(f.y[out] - ridge.predict(f.x[out], f.dense[out])))
    return ridge


def fit_remaining(f: Featurized, total: Ridge, rows: np.ndarray, seed: int) -> Ridge:
    """On the prefixes of the responses in `rows`, the prompt-only estimate from `total`."""
    chosen = np.flatnonzero(np.isin(f.prefix_example, rows))
    held = np.isin(f.prefix_example[chosen], rows[_sigma_split(f, rows, seed)])
    x, y = f.px[chosen], f.py[chosen]
    dense = remaining_dense(f, total, chosen)
    ridge = Ridge.fit(x[~held], dense[~held], y[~held], REMAINING_ALPHA)
    ridge.sigma = float(np.std(y[held] - ridge.predict(x[held], dense[held])))
    return ridge


def remaining_dense(f: Featurized, total: Ridge, chosen: np.ndarray) -> np.ndarray:
    examples = f.prefix_example[chosen]
    return RemainingModel.with_mu(f.pdense[chosen], total.predict(f.x[examples], f.dense[examples]))


def evaluate(
    name: str, f: Featurized, train: np.ndarray, test: np.ndarray, seed: int, by_family: bool = False
) -> tuple[list[Scores], list[dict]]:
    """The prompt-only model against the constant (and within each generator family with 200
    held-out responses, if `by_family`), and the remaining-length model by tokens seen
    (`evaluate_remaining`), trained on `train`, scored on `test`."""
    actual = np.expm1(f.y[test])
    generators = [f.examples[i].generator for i in test]
    median = float(np.median(np.expm1(f.y[train])))
    constant = score(
        f"{name}: constant (training median)",
        np.full(len(test), median),
        np.full(len(test), bucket_of(int(round(median)))),
        actual,
        generators,
    )
    total = fit_total(f, train, seed)
    mu = total.predict(f.x[test], f.dense[test])
    buckets = bucket_probs(mu, total.sigma).argmax(1)
    scores = [constant, score(f"{name}: regression", np.expm1(mu), buckets, actual, generators)]
    families = np.array([f.examples[i].family for i in test])
    for family in sorted(set(families)) if by_family else ():
        rows = families == family
        if rows.sum() >= 200:
            chosen = [g for g, keep in zip(generators, rows) if keep]
            scores += [
                score(
                    f"{name}, {family} family: constant",
                    np.full(rows.sum(), median),
                    np.full(rows.sum(), bucket_of(int(round(median)))),
                    actual[rows],
                    chosen,
                ),
                score(f"{name}, {family} family: regression", np.expm1(mu[rows]), buckets[rows], actual[rows], chosen),
            ]
    remaining = fit_remaining(f, total, train, seed)
    return scores, evaluate_remaining(name, f, total, remaining, test)


def evaluate_remaining(name: str, f: Featurized, total: Ridge, remaining: Ridge, test: np.ndarray) -> list[dict]:
    """By tokens seen: the MAE of the total length as the prompt-only model predicts it and as
    `seen` + the remaining-length model's estimate, on the requests still running there."""
    chosen = np.flatnonzero(np.isin(f.prefix_example, test))
    seen = np.array([f.prefixes[i].seen for i in chosen])
    examples = f.prefix_example[chosen]
    actual = np.expm1(f.y[examples])
    prompt_only = np.expm1(total.predict(f.x[examples], f.dense[examples]))
    refined = seen + np.expm1(remaining.predict(f.px[chosen], remaining_dense(f, total, chosen)))
    out = []
    for k in sorted(set(seen.tolist())):
        at = seen == k
        # the prompt-only estimate, told the request is still running: at least k + 1
        before = np.abs(np.maximum(prompt_only[at], k + 1) - actual[at]).mean()
        after = np.abs(refined[at] - actual[at]).mean()
        out.append(
            {
                "split": name,
                "seen": k,
                "rows": int(at.sum()),
                "mae_prompt_only": float(before),
                "mae_refined": float(after),
                "ratio": float(after / before),
                "kendall_tau_remaining": float(stats.kendalltau(refined[at] - k, actual[at] - k).statistic)
                if at.sum() > 1
                else None,
            }
        )
    return out


def run(
    *,
    seed: int = 0,
    limit_prompts: int | None = None,
    out: Path | None = None,
    quiet: bool = False,
    sources: tuple[str, ...] = data.SOURCES,
    leave_one_out: bool = True,
) -> dict:
    started = time.monotonic()
    say = (lambda *a: None) if quiet else print
    tokenizer = load_tokenizer()
    examples = data.load(token_counter(tokenizer), sources, limit_prompts=limit_prompts, keep_text=True)
    f = Featurized(examples, prefixes(tokenizer, examples))
    say(
        f"{len(examples)} responses to {len({e.prompt for e in examples})} prompts from "
        f"{len({e.generator for e in examples})} generators, {len(f.prefixes)} prefixes "
        f"({time.monotonic() - started:.0f} s)"
    )
    report: dict = {"total": [], "remaining": []}
    splits = [
        (f"held-out source {s}", [e for e in examples if e.source != s], [e for e in examples if e.source == s])
        for s in sources
        if leave_one_out and len(sources) > 1
    ]
    splits.append(("split by prompt, all sources", *data.split_by_prompt(examples, 0.2, seed)))
    for name, train, test in splits:
        scores, by_seen = evaluate(name, f, f.rows(train), f.rows(test), seed, by_family=name.startswith("split"))
        report["total"] += [asdict(s) for s in scores]
        report["remaining"] += by_seen
        say(f"{name}: {len(train)} training, {len(test)} held-out responses ({time.monotonic() - started:.0f} s)")
    if out is not None:
        everything = np.arange(len(examples))
        total = fit_total(f, everything, seed)
        remaining = fit_remaining(f, total, everything, seed)
        info = {
            "seed": seed,
            "sources": list(sources),
            "responses": len(examples),
            "alphas": [TOTAL_ALPHA, REMAINING_ALPHA],
        }
        total.info, remaining.info = info, info
        out.mkdir(parents=True, exist_ok=True)
        total.save(out / "total")
        remaining.save(out / "remaining")
        (out / "evaluation.json").write_text(json.dumps(report, indent=1) + "\n")
    say(tables(report))
    return report


def tables(report: dict) -> str:
    pct = lambda v: f"{v:.1%}"  # noqa: E731
    num = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        "| split: predictor | responses | exact bucket | ±1 bucket | MAE tokens | Kendall tau "
        "| tau per generator | Spearman |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['name']} | {s['rows']} | {pct(s['exact'])} | {pct(s['within_one'])} | {s['mae_tokens']:.0f} | "
        f"{num(s['kendall_tau'])} | {num(s['kendall_tau_per_generator'])} | {num(s['spearman'])} |"
        for s in report["total"]
    ]
    lines += [
        "",
        "| split | tokens seen | requests still running | MAE prompt-only | MAE refined | ratio | tau (remaining) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['split']} | {r['seen']} | {r['rows']} | {r['mae_prompt_only']:.0f} | {r['mae_refined']:.0f} | "
        f"{r['ratio']:.2f} | {num(r['kendall_tau_remaining'])} |"
        for r in report["remaining"]
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-prompts", type=int, default=None, help="train on a slice: this many prompts a source")
    parser.add_argument("--sources", nargs="+", default=list(data.SOURCES), choices=data.SOURCES)
    parser.add_argument("--out", type=Path, default=None, help="write the artifact here")
    args = parser.parse_args()
    run(seed=args.seed, limit_prompts=args.limit_prompts, out=args.out, sources=tuple(args.sources))


if __name__ == "__main__":
    main()
