"""The length models loaded for serving: batches in, predictions out; and the refit of the
calibration on what a deployment observed.

The artifact's regressions give a score (log-length) per request; the `Head` maps it to the
deployment's lengths (`a·score + b`, with its spread) and says whether it carries information:
a refit on the deployment's own (prompt, actual length) pairs replaces it only if it lowers the
held-out log loss, and marks it uninformative when its MAE there does not beat the constant's
(the policies then fall back as if there were no prediction). Served models differ in verbosity,
so each may have a head of its own (`model_heads`); one without uses the shared head (`head`),
and its first refit is gated against that. A head is swapped as one reference, so a batch sees
one version of each.
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


@dataclass(frozen=True)
class Head:
    """log1p(length) ~ Normal(a·score + b, sigma); `informative`: its MAE beat the constant's where it
    was last checked."""

    a: float = 1.0
    b: float = 0.0
    sigma: float = 1.0
    informative: bool = True

    @cached_property
    def version(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def mu(self, score: np.ndarray) -> np.ndarray:
        return self.a * score + self.b

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Head:
        fields = json.loads(blob)
        head = cls(float(fields["a"]), float(fields["b"]), float(fields["sigma"]), bool(fields["informative"]))
        if not all(map(math.isfinite, (head.a, head.b, head.sigma))) or head.sigma <= 0:
            raise ValueError(f"a head needs finite a, b and a positive sigma: {fields}")
        return head


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

    def _calibrated(self, prompts: list[str], models: list[str] | None) -> tuple[list[Head], np.ndarray, np.ndarray]:
        """Each prompt's head (its model's), log-length estimate and its spread."""
        heads = [self.head_for(m) for m in models or [""] * len(prompts)]
        a, b, sigma = (np.array([getattr(h, name) for h in heads]) for name in ("a", "b", "sigma"))
        return heads, a * self.scores(prompts) + b, sigma

    def predict(self, prompts: list[str], chars: list[int], models: list[str] | None = None) -> list[LengthPrediction]:
        """Predictions for prompts cut by `cut_prompt`, whose full lengths are `chars`, by the heads of
        the served `models` that will answer them (None: the shared head)."""
        heads, mu, sigma = self._calibrated(prompts, models)
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
        heads, mu, _ = self._calibrated(prompts, models)
        remaining = np.expm1(self.remaining.predict(prompts, generated, counted, mu))
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
        """Fit a new head on (score, actual length) pairs and score it against `current` on held-out
        ones: the new head if its log loss there is lower (else None), and both scores."""
        y = np.log1p(fit_lengths)
        a, b = np.polyfit(fit_scores, y, 1) if len(set(fit_scores.tolist())) > 1 else (0.0, float(y.mean()))
        sigma = max(float(np.std(y - (a * fit_scores + b))), MIN_SIGMA)
        median = float(np.median(fit_lengths))
        constant_mae = float(np.abs(median - np.array(held_lengths)).mean())
        candidate = Head(float(a), float(b), sigma)
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
