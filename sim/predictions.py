"""Output-length predictions for trace requests: the real predictor's, an oracle's, or none.

Traces carry lengths, not prompts, so the length predictor cannot run on them. What it can give
is its error: `python -m llmesh_sim.predictions` runs the committed artifact, loaded as the
service loads it, on the held-out split it was scored on (meta.json), and writes
(actual, expected, bucket, confidence) per held-out response, numbers only:

    .venv/bin/python -m llmesh_sim.predictions [--out sim/profiles/predictor-heldout-llama.json] [--runtime torch]

`HeldOutPredictions.predict` then gives a trace request of true length n the expected length the
predictor gave a held-out response whose true length fell in n's length bucket
(llmesh.lengths.EDGES; the nearest bucket that has rows where n's has none): the predictor's
error distribution per class of true length, without the true length leaking into the guess.

Units: the held-out lengths (actual and expected) are the encoder's WordPiece tokens (the
bert-base-uncased vocabulary of all-MiniLM-L6-v2; llmesh_lengthpred.data), the traces' are
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

from llmesh.lengths import EDGES

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


def with_predictions(requests: Sequence[SimRequest], mode: str, seed: int = 0,
                     heldout: HeldOutPredictions | None = None) -> Sequence[SimRequest]:
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
            r.predicted_tokens = heldout.predict(r.output_tokens, rng)
        else:
            r.predicted_tokens = None
    return requests


def held_out_rows(runtime: str | None = None) -> tuple[list[list[float]], dict]:
    """Run the committed artifact, built as the service builds it, on its held-out split: the rows
    (actual, expected, bucket, confidence) and what produced them."""
    from llmesh.lengths import cut_prompt
    from llmesh_lengthpred import data
    from llmesh_lengthpred.predictor import Predictor
    from llmesh_lengthpred.settings import LengthPredictorSettings

    settings = LengthPredictorSettings()  # MESH_LENGTH_* as the service reads them
    if runtime is not None:
        settings = settings.model_copy(update={"length_runtime": runtime})
    # as LengthPredictorService.create
    predictor = Predictor(settings.length_artifact_dir, "heldout", settings.length_threads, settings.length_runtime)
    meta = predictor.meta
    family, seed = meta["family"], int(meta["seed"])
    count = lambda text: len(predictor.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731 as train.py
    train, test = data.split_by_prompt(data.load(family, count), TEST_FRACTION, seed)
    if "train_responses" in meta and len(train) != meta["train_responses"]:
        print(f"predictions: {len(train)} training responses, meta.json says {meta['train_responses']}: "
              "the data is not what the artifact was trained on", file=sys.stderr)
    rows = []
    for start in range(0, len(test), settings.length_max_batch):  # as the service's batches, at most this many
        chunk = test[start : start + settings.length_max_batch]
        cut = [cut_prompt(e.prompt) for e in chunk]  # as LengthPredictorService.predict
        for e, p in zip(chunk, predictor.predict([text for text, _ in cut], [chars for _, chars in cut])):
            rows.append([e.output_tokens, p.expected_tokens, p.bucket, p.confidence])
    info = {"family": family, "seed": seed, "test_fraction": TEST_FRACTION, "runtime": settings.length_runtime,
            "model_version": predictor.version, "train_responses": len(train),
            "artifact": _relative(Path(settings.length_artifact_dir)), "meta_scores": meta.get("scores", [])}
    return rows, info


def scores(rows: Sequence[Sequence[float]], edges: Sequence[int] = EDGES) -> dict[str, float]:
    """Exact-bucket and ±1-bucket accuracy and MAE (tokens), as train.py scores them."""
    truth = [bisect_right(edges, int(a)) for a, *_ in rows]
    return {"rows": len(rows),
            "exact": sum(t == int(r[2]) for t, r in zip(truth, rows)) / len(rows),
            "within_one": sum(abs(t - int(r[2])) <= 1 for t, r in zip(truth, rows)) / len(rows),
            "mae_tokens": sum(abs(r[1] - r[0]) for r in rows) / len(rows)}


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--runtime", choices=["onnx-int8", "torch-int8", "torch"], default=None,
                        help="the encoder's runtime (default: the service's, MESH_LENGTH_RUNTIME or onnx-int8)")
    args = parser.parse_args(argv)
    rows, info = held_out_rows(args.runtime)
    got = scores(rows)
    fine_tuned = next((s for s in info.pop("meta_scores") if s.get("name") == "MiniLM + LoRA, fine-tuned"), None)
    command = " ".join(["python -m llmesh_sim.predictions", *(argv if argv is not None else sys.argv[1:])])
    out = {"command": command,
           "source": "llmesh_lengthpred's committed artifact, built as the service builds it, on the held-out "
                     "split it was scored on; lengths in the encoder's WordPiece tokens (traces: Llama tokens)",
           **info, "bucket_edges": list(EDGES),
           "scores": {k: round(v, 4) for k, v in got.items()},
           "meta_json_scores": None if fine_tuned is None else
           {k: round(fine_tuned[k], 4) for k in ("exact", "within_one", "mae_tokens")},
           "columns": COLUMNS,
           "rows": [[int(a), round(e, 1), int(b), round(c, 3)] for a, e, b, c in rows]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=2, ensure_ascii=False)[: -len("\n}")]
    body = ",\n".join("    " + json.dumps(r) for r in out["rows"])  # a row a line: small diffs
    args.out.write_text(f'{head},\n  "rows": [\n{body}\n  ]\n}}\n')
    line = (f"predictions: {got['rows']} held-out rows ({info['runtime']}, model {info['model_version']}): "
            f"MAE {got['mae_tokens']:.1f} tokens, exact bucket {got['exact']:.1%}, ±1 {got['within_one']:.1%}")
    if fine_tuned is not None:
        line += (f"; meta.json: MAE {fine_tuned['mae_tokens']:.1f}, exact {fine_tuned['exact']:.1%}, "
                 f"±1 {fine_tuned['within_one']:.1%}")
    print(line)
    print(json.dumps({"out": _relative(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
