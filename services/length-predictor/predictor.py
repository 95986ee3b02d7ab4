"""The length models loaded for serving: batches in, predictions out; and the refit of the
calibration on what a deployment observed.

The artifact's regressions give a score (log-length) per request; the `Head` maps it to the
deployment's lengths (`a·score + b`, the mean log-length, moved by `shift` to the median, with its
spread) and says whether it carries information: a refit on the deployment's own (prompt, actual
length) pairs replaces it only if it lowers the held-out log loss, and marks it uninformative when
its MAE there does not beat the constant's (the policies then fall back as if there were no
prediction). A refit is fitted for MAE, the measure its predictions are judged by: the median of
its residuals is 0 on the samples it was fitted on, and its slope is the least-squares one shrunk
toward 0 as far as their MAE says (0: the samples' median, so on them it is never worse than the
constant). Served models differ in verbosity, so each may have a head of its own (`model_heads`);
one without uses the shared head (`head`), and its first refit is gated against that. A head is
swapped as one reference, so a batch sees one version of each.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from llmesh.wire.lengths import bucket_label, bucket_of
from llmesh.wire.messages import LengthPrediction, LengthRemaining

from . import data
from .model import load_tokenizer
from .regression import RemainingModel, Ridge, TotalModel, bucket_probs
from .settings import ARTIFACT_DIR
from .train import score

REFIT_SEED = 0
MIN_SIGMA = 0.05
SLOPE_SHRINK = tuple(float(f) for f in np.linspace(0.0, 1.0, 21))  # fractions of the least-squares slope a refit tries


@dataclass(frozen=True)
class Head:
    """log1p(length) ~ Normal(a·score + b + shift, sigma): `a·score + b` is the mean log-length (the
    scale the remaining-length model reads its prompt-only estimate in), `shift` moves it to the
    median (the point estimate, which MAE rewards, and the buckets' centre; 0 in the artifact's
    head); `informative`: its MAE beat the constant's where it was last checked."""

    a: float = 1.0
    b: float = 0.0
    sigma: float = 1.0
    informative: bool = True
    shift: float = 0.0

    def _fields(self) -> dict:
        fields = asdict(self)
        if not fields["shift"]:
            del fields["shift"]  # a head without one keeps the version and bytes it had before `shift`
        return fields

    @cached_property
    def version(self) -> str:
        return hashlib.sha256(json.dumps(self._fields(), sort_keys=True).encode()).hexdigest()[:12]

    def mean_log(self, score: np.ndarray) -> np.ndarray:
        """The mean of log1p(length): the remaining-length model's prompt-only input."""
        return self.a * score + self.b

    def mu(self, score: np.ndarray) -> np.ndarray:
        """The median of log1p(length): the point estimate and the buckets' centre."""
        return self.a * score + self.b + self.shift

    def to_bytes(self) -> bytes:
        return json.dumps(self._fields(), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Head:
        fields = json.loads(blob)
        head = cls(
            float(fields["a"]),
            float(fields["b"]),
            float(fields["sigma"]),
            bool(fields["informative"]),
            float(fields.get("shift", 0.0)),
        )
        if not all(map(math.isfinite, (head.a, head.b, head.sigma, head.shift))) or head.sigma <= 0:
            raise ValueError(f"a head needs finite a, b, shift and a positive sigma: {fields}")
        return head

    @classmethod
    def fit(cls, scores: np.ndarray, lengths: list[int]) -> Head:
        """The head fitted for MAE on (score, actual length) pairs: the least-squares slope on log-length,
        shrunk toward 0 to the fraction (of SLOPE_SHRINK) with the lowest MAE in tokens on these pairs
        (the smallest of equals: 0 is the pairs' median, the constant); `b` centres it on the mean of
        log1p(length), `shift` moves that to the median of its residuals, and sigma is their spread
        around the median."""
        actual = np.asarray(lengths, dtype=float)
        y = np.log1p(actual)
        slope = float(np.polyfit(scores, y, 1)[0]) if len(set(scores.tolist())) > 1 else 0.0
        best: tuple[float, float] | None = None  # (MAE, a)
        for fraction in SLOPE_SHRINK:
            a = fraction * slope
            mae = float(np.abs(np.expm1(a * scores + np.median(y - a * scores)) - actual).mean())
            if best is None or mae < best[0] - 1e-9 * max(best[0], 1.0):
                best = (mae, a)
        assert best is not None
        a = float(best[1])
        residuals = y - a * scores
        b = float(residuals.mean())
        shift = float(np.median(residuals)) - b
        sigma = max(float(np.sqrt(np.mean((residuals - b - shift) ** 2))), MIN_SIGMA)
        return cls(a, b, sigma, shift=shift)


class Predictor:
    """Synchronous: the service calls it from its one model thread."""

    def __init__(self, artifact: Path = ARTIFACT_DIR, replica: str = "local", generator: str = data.UNKNOWN):
        total = Ridge.load(artifact / "total")
        self.total = TotalModel(total)
        self.remaining = RemainingModel(Ridge.load(artifact / "remaining"), self.total.hasher)
        self.meta = total.info
        self.tokenizer = load_tokenizer()  # the unit the models count in (WordPiece)
        self.replica, self.generator = replica, generator or data.UNKNOWN
        self.head = Head(sigma=total.sigma)  # the shared head: the artifact's, or its refit on every model's lengths
        self.model_heads: dict[str, Head] = {}  # served model -> its own head, once a refit of it was accepted
        self.base_version = hashlib.sha256((artifact / "total.npz").read_bytes()).hexdigest()[:12]
        self.predict(["warm-up"], [7])

    def head_for(self, model: str) -> Head:
        """The head that serves `model`: its own, else the shared one."""
        return self.model_heads.get(model, self.head) if model else self.head

    def version_for(self, model: str) -> str:
        return f"{self.base_version}-{self.head_for(model).version}"

    @property
    def version(self) -> str:
        """The shared head's version."""
        return self.version_for("")

    def scores(self, prompts: list[str]) -> np.ndarray:
        """The artifact's log-length score of each prompt (what a refit calibrates)."""
        return self.total.predict(prompts, [self.generator] * len(prompts))

    def _calibrated(
        self, prompts: list[str], models: list[str] | None
    ) -> tuple[list[Head], np.ndarray, np.ndarray, np.ndarray]:
        """Each prompt's head (its model's), median and mean log-length estimates, and their spread."""
        heads = [self.head_for(m) for m in models or [""] * len(prompts)]
        a, b, shift, sigma = (np.array([getattr(h, name) for h in heads]) for name in ("a", "b", "shift", "sigma"))
        mean = a * self.scores(prompts) + b
        return heads, mean + shift, mean, sigma

    def predict(self, prompts: list[str], chars: list[int], models: list[str] | None = None) -> list[LengthPrediction]:
        """Predictions for prompts cut by `cut_prompt`, whose full lengths are `chars`, by the heads of
        the served `models` that will answer them (None: the shared head)."""
        heads, mu, _, sigma = self._calibrated(prompts, models)
        probs = bucket_probs(mu, sigma)
        out = []
        for row, m, prompt, c, head in zip(probs, mu, prompts, chars, heads):
            bucket = int(row.argmax())
            out.append(
                LengthPrediction(
                    bucket=bucket,
                    label=bucket_label(bucket),
                    expected_tokens=float(np.expm1(m)),
                    confidence=float(row[bucket]) if head.informative else 0.0,
                    informative=head.informative,
                    truncated=c > len(prompt),
                    model_version=f"{self.base_version}-{head.version}",
                    replica=self.replica,
                )
            )
        return out

    def predict_remaining(
        self,
        prompts: list[str],
        generated: list[str],
        chars: list[int],
        tokens: list[int],
        models: list[str] | None = None,
    ) -> list[LengthRemaining]:
        """Tokens still to come after `generated` (the end of an output `chars` characters and `tokens`
        of the serving model's tokens long): estimated in the models' unit (counted on the text at hand,
        extrapolated by characters beyond it) and scaled back by the ratio of the two counts."""
        counted = [
            round(len(ids) * c / len(text)) if text else 0
            for ids, text, c in zip(self.tokenizer(generated, add_special_tokens=False)["input_ids"], generated, chars)
        ]
        # the remaining-length model was trained on the artifact's mean log-length: it reads the mean
        heads, _, mean, _ = self._calibrated(prompts, models)
        remaining = np.expm1(self.remaining.predict(prompts, generated, counted, mean))
        out = []
        for r, n, own, head in zip(remaining, tokens, counted, heads):
            scale = n / own if own else 1.0
            out.append(
                LengthRemaining(
                    remaining_tokens=float(r * scale),
                    generated_tokens=n,
                    informative=head.informative,
                    model_version=f"{self.base_version}-{head.version}",
                    replica=self.replica,
                )
            )
        return out

    @staticmethod
    def refit_head(
        current: Head,
        fit_scores: np.ndarray,
        fit_lengths: list[int],
        held_scores: np.ndarray,
        held_lengths: list[int],
    ) -> tuple[Head | None, dict[str, float], dict[str, float]]:
        """Fit a new head on (score, actual length) pairs (`Head.fit`) and score it against `current` on
        held-out ones: the new head if its log loss there is lower (else None), and both scores."""
        median = float(np.median(fit_lengths))
        constant_mae = float(np.abs(median - np.array(held_lengths)).mean())
        candidate = Head.fit(fit_scores, fit_lengths)
        after = _scores(candidate, held_scores, held_lengths)
        candidate = replace(candidate, informative=after["mae_tokens"] < constant_mae)
        before = _scores(current, held_scores, held_lengths)
        after["constant_mae_tokens"] = before["constant_mae_tokens"] = constant_mae
        return (candidate if after["log_loss"] < before["log_loss"] else None), before, after


def refit_split(samples: list[data.Example], holdout_fraction: float) -> tuple[list[data.Example], list[data.Example]]:
    """Fitting and held-out samples, split by prompt."""
    fit, held = data.split_by_prompt(samples, holdout_fraction, REFIT_SEED)
    if not fit or not held:
        raise ValueError(
            f"{len(samples)} samples from {len({s.prompt for s in samples})} prompts "
            "do not split into a fitting and a held-out part"
        )
    return fit, held


def _scores(head: Head, scores: np.ndarray, actual: list[int]) -> dict[str, float]:
    mu = head.mu(scores)
    probs = bucket_probs(mu, head.sigma)
    truth = np.array([bucket_of(n) for n in actual])
    s = score("", np.expm1(mu), probs.argmax(1), np.array(actual, dtype=float), [])
    return {
        "log_loss": -float(np.mean(np.log(np.maximum(probs[np.arange(len(truth)), truth], 1e-9)))),
        "exact": s.exact,
        "within_one": s.within_one,
        "mae_tokens": s.mae_tokens,
    }
