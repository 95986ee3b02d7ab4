"""Output-length predictions for trace requests: the real predictor's, an oracle's, or none.

Traces carry lengths, not prompts, so the length predictor cannot run on them. What it can give
is its error: `python -m llmesh_sim.predictions` fits the prompt-only model as the length
predictor's training does, on all but a held-out fifth of the prompts, and writes (actual,
expected, bucket, confidence) per held-out response of one generator family, numbers only:

    .venv/bin/python -m llmesh_sim.predictions [--out sim/profiles/predictor-heldout-llama.json] [--family llama]

`HeldOutPredictions.predict` then gives a trace request of true length n the expected length the
predictor gave a held-out response whose true length fell in n's length bucket
(llmesh.wire.lengths.EDGES; the nearest bucket that has rows where n's has none): the predictor's
error distribution per class of true length, without the true length leaking into the guess.

Units: the held-out lengths (actual and expected) are WordPiece tokens (the bert-base-uncased
vocabulary; llmesh_lengthpred.model), the traces' are
Llama tokens. A trace length is bucketed as if it were WordPiece and the returned guess is a
WordPiece count; on English text the two counts are close, but not equal.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from bisect import bisect_right
from collections.abc import Sequence
from pathlib import Path

from llmesh.wire.lengths import EDGES

from .engine import SimRequest

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "predictor-heldout-llama.json"
MODES = ("oracle", "real", "none")
# train.py's held-out share (its `split_by_prompt(examples, 0.2, seed)`; meta.json does not record it)
TEST_FRACTION = 0.2
COLUMNS = ["actual_tokens", "expected_tokens", "bucket_index", "confidence"]


class HeldOutPredictions:
    """The predictor's held-out rows, by the bucket of their actual length."""

    def __init__(self, rows: Sequence[Sequence[float]], edges: Sequence[int] = EDGES):
        """`rows`: [actual_tokens, expected_tokens, bucket_index, confidence]; `edges`: the upper
        bounds of the bounded length buckets (the last bucket has none)."""
        self.rows = [tuple(r) for r in rows]
        self.edges = tuple(edges)
        self.by_bucket: list[list[float]] = [[] for _ in range(len(self.edges) + 1)]
        for actual, expected, *_ in self.rows:
            self.by_bucket[self.bucket_of(int(actual))].append(float(expected))
        self._filled = [b for b, rows in enumerate(self.by_bucket) if rows]
        if not self._filled:
            raise ValueError("no held-out rows")

    @classmethod
    def load(cls, path: Path = DEFAULT_PROFILE) -> HeldOutPredictions:
        raw = json.loads(Path(path).read_text())
        return cls(raw["rows"], raw.get("bucket_edges", EDGES))

    def bucket_of(self, tokens: int) -> int:
        return bisect_right(self.edges, tokens)  # [0, e0) -> 0, [e0, e1) -> 1, ..., >= e_last -> len(edges)

    def source_bucket(self, actual_tokens: int) -> int:
        """The bucket whose rows answer for `actual_tokens`: its own, else the nearest with rows
        (the lower one of two as near)."""
        own = self.bucket_of(actual_tokens)
        return min(self._filled, key=lambda b: (abs(b - own), b))

    def predict(self, actual_tokens: int, rng: random.Random) -> float:
        """The expected length the predictor gave a random held-out response of the same length
        bucket as `actual_tokens` (deterministic for a given `rng` state)."""
        return rng.choice(self.by_bucket[self.source_bucket(actual_tokens)])


def with_predictions(
    requests: Sequence[SimRequest], mode: str, seed: int = 0, heldout: HeldOutPredictions | None = None
) -> Sequence[SimRequest]:
    """Set each request's `predicted_tokens` (in place; returns `requests`): "oracle" its
    `output_tokens`, "real" a draw from `heldout` (one `random.Random(seed)`, in list order, so
    the same requests and seed get the same predictions), "none" None."""
    if mode not in MODES:
        raise ValueError(f"unknown prediction mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "real" and heldout is None:
        raise ValueError('mode "real" needs the held-out predictions (HeldOutPredictions.load())')
    rng = random.Random(seed)
    for r in requests:
        if mode == "oracle":
            r.predicted_tokens = float(r.output_tokens)
        elif mode == "real":
            assert heldout is not None
            r.predicted_tokens = heldout.predict(r.output_tokens, rng)
        else:
            r.predicted_tokens = None
    return requests


def held_out_rows(family: str = "llama", seed: int = 0) -> tuple[list[list[float]], dict]:
    """The prompt-only model as `llmesh_lengthpred.train` fits it, trained on every source's prompts
    but a held-out fifth (split by prompt), on the held-out responses of the `family`'s generators:
    the rows (actual, expected, bucket, confidence) and what produced them."""
    import numpy as np

    from llmesh_lengthpred import data, train
    from llmesh_lengthpred.model import load_tokenizer
    from llmesh_lengthpred.regression import bucket_probs

    examples = data.load(train.token_counter(load_tokenizer()))
    features = train.Featurized(examples, [])
    fit, test = data.split_by_prompt(examples, TEST_FRACTION, seed)
    test = [e for e in test if e.family == family]
    ridge = train.fit_total(features, features.rows(fit), seed)
    rows = features.rows(test)
    mu = ridge.predict(features.x[rows], features.dense[rows])
    probs = bucket_probs(mu, ridge.sigma)
    out = [[e.output_tokens, float(np.expm1(m)), int(p.argmax()), float(p.max())] for e, m, p in zip(test, mu, probs)]
    info = {
        "family": family,
        "seed": seed,
        "test_fraction": TEST_FRACTION,
        "train_responses": len(fit),
        "model": "llmesh_lengthpred.train's prompt-only regression, all sources",
    }
    return out, info


def scores(rows: Sequence[Sequence[float]], edges: Sequence[int] = EDGES) -> dict[str, float]:
    """Exact-bucket and ±1-bucket accuracy and MAE (tokens), as train.py scores them."""
    truth = [bisect_right(edges, int(a)) for a, *_ in rows]
    return {
        "rows": len(rows),
        "exact": sum(t == int(r[2]) for t, r in zip(truth, rows)) / len(rows),
        "within_one": sum(abs(t - int(r[2])) <= 1 for t, r in zip(truth, rows)) / len(rows),
        "mae_tokens": sum(abs(r[1] - r[0]) for r in rows) / len(rows),
    }


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--family", default="llama", help="the generators whose held-out responses are kept")
    args = parser.parse_args(argv)
    rows, info = held_out_rows(args.family)
    got = scores(rows)
    command = " ".join(["python -m llmesh_sim.predictions", *(argv if argv is not None else sys.argv[1:])])
    out = {
        "command": command,
        "source": "llmesh_lengthpred.train's prompt-only model on the prompts it was not fitted on; lengths in "
        "WordPiece tokens (llmesh_lengthpred.model; traces: Llama tokens)",
        **info,
        "bucket_edges": list(EDGES),
        "scores": {k: round(v, 4) for k, v in got.items()},
        "columns": COLUMNS,
        "rows": [[int(a), round(e, 1), int(b), round(c, 3)] for a, e, b, c in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=2, ensure_ascii=False)[: -len("\n}")]
    body = ",\n".join("    " + json.dumps(r) for r in out["rows"])  # a row a line: small diffs
    args.out.write_text(f'{head},\n  "rows": [\n{body}\n  ]\n}}\n')
    print(
        f"predictions: {got['rows']} held-out {info['family']} rows: MAE {got['mae_tokens']:.1f} tokens, "
        f"exact bucket {got['exact']:.1%}, ±1 {got['within_one']:.1%}"
    )
    print(json.dumps({"out": _relative(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
