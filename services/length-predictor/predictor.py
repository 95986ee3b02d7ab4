"""The length model loaded for serving: batches of prompts in, predictions out; and the refit of
its head on what a deployment observed.

Synchronous. Call it from one thread only: each thread that runs torch gets its own OpenMP
team, and two teams on a small CPU slow every call down (measured: 11 -> 19 ms per prompt
on 2 cores). The head is swapped as one reference, so a batch sees one version.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llmesh.lengths import NUM_BUCKETS, bucket_label, bucket_medians, bucket_of
from llmesh.messages import LengthPrediction

from . import data, model
from .settings import ARTIFACT_DIR
from .train import from_probs

FEATURE_BATCH = 8  # prompts of similar length per encoder call: batching pays on CPU only with little padding
REFIT_LR = 1e-2
REFIT_SEED = 0


@dataclass(frozen=True)
class Head:
    """What a refit replaces: the linear layer over the features and each bucket's median length."""

    linear: nn.Linear
    medians: list[float]

    @cached_property
    def version(self) -> str:
        digest = hashlib.sha256(json.dumps(self.medians).encode())
        for tensor in (self.linear.weight, self.linear.bias):
            digest.update(tensor.detach().float().numpy().tobytes())
        return digest.hexdigest()[:12]

    def probs(self, features: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return torch.softmax(self.linear(features), 1).numpy()

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"state": self.linear.state_dict(), "medians": self.medians}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes, like: nn.Linear) -> Head:
        saved = torch.load(io.BytesIO(blob), weights_only=True)
        linear = nn.Linear(like.in_features, like.out_features)
        linear.load_state_dict(saved["state"])
        medians = [float(m) for m in saved["medians"]]
        if len(medians) != NUM_BUCKETS:
            raise ValueError(f"a head has {NUM_BUCKETS} bucket medians, not {len(medians)}")
        return cls(linear, medians)


class Predictor:
    def __init__(self, artifact: Path = ARTIFACT_DIR, replica: str = "local", threads: int = 0,
                 runtime: str = "torch"):
        if threads:
            torch.set_num_threads(threads)
        loaded, medians, self.meta = model.load(artifact)
        loaded.encoder = loaded.encoder.merge_and_unload()  # LoRA folded into the weights: ~15% faster
        loaded.encoder = model.compiled(loaded.encoder, runtime, threads)
        self.tokenizer = model.load_tokenizer()
        self.model, self.replica = loaded, replica
        self.max_prompt_tokens = int(self.meta.get("max_prompt_tokens", model.MAX_PROMPT_TOKENS))
        self.head = Head(loaded.head, medians)
        self.base_version = self.head.version  # the artifact's: refits are only valid on its encoder
        self.predict(["warm-up"], [7])  # torch's first call sets up its kernels: not on a request's clock

    @property
    def version(self) -> str:
        return self.head.version

    def features(self, prompts: list[str], chars: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """The head's input for each prompt, and each prompt's length in tokens. Prompts go through
        the encoder in order of length, so that a batch pads little."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        features: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
        lengths = [0] * len(prompts)
        with torch.no_grad():
            for start in range(0, len(order), FEATURE_BATCH):
                rows = order[start : start + FEATURE_BATCH]
                batch = model.encode(self.tokenizer, [prompts[i] for i in rows], self.max_prompt_tokens,
                                     None if chars is None else [chars[i] for i in rows])
                for i, f, n in zip(rows, self.model.features(batch), batch["prompt_tokens"].tolist()):
                    features[i], lengths[i] = f, n
        return torch.stack(features), lengths

    def predict(self, prompts: list[str], chars: list[int]) -> list[LengthPrediction]:
        """Predictions for prompts cut by `cut_prompt`, whose full lengths are `chars`."""
        head = self.head
        features, tokens = self.features(prompts, chars)
        probs = head.probs(features)
        expected = probs @ np.array(head.medians)
        out = []
        for row, n, e, p, c in zip(probs, tokens, expected, prompts, chars):
            bucket = int(row.argmax())
            out.append(LengthPrediction(
                bucket=bucket, label=bucket_label(bucket), expected_tokens=float(e), confidence=float(row[bucket]),
                truncated=n > self.max_prompt_tokens or c > len(p), model_version=head.version, replica=self.replica))
        return out

    def refit_head(self, x_fit: torch.Tensor, fit_lengths: list[int], x_held: torch.Tensor, held_lengths: list[int],
                   epochs: int) -> tuple[Head | None, dict[str, float], dict[str, float]]:
        """Fit a new head on (features, actual length) pairs and score it against the current head
        on held-out ones: the new head if its log loss there is lower (else None), and both scores."""
        current = self.head
        candidate = Head(_fit_linear(current.linear, x_fit, [bucket_of(n) for n in fit_lengths], epochs),
                         bucket_medians(fit_lengths, fallback=current.medians, min_count=3))
        before, after = _scores(current, x_held, held_lengths), _scores(candidate, x_held, held_lengths)
        return (candidate if after["log_loss"] < before["log_loss"] else None), before, after


def refit_split(samples: list[data.Example], holdout_fraction: float) -> tuple[list[data.Example], list[data.Example]]:
    """Fitting and held-out samples, split by prompt."""
    fit, held = data.split_by_prompt(samples, holdout_fraction, REFIT_SEED)
    if not fit or not held:
        raise ValueError(f"{len(samples)} samples from {len({s.prompt for s in samples})} prompts "
                         "do not split into a fitting and a held-out part")
    return fit, held


def _fit_linear(start: nn.Linear, x: torch.Tensor, labels: list[int], epochs: int) -> nn.Linear:
    torch.manual_seed(REFIT_SEED)
    linear = nn.Linear(start.in_features, start.out_features)
    linear.load_state_dict(start.state_dict())
    optimizer = torch.optim.Adam(linear.parameters(), lr=REFIT_LR)
    target = torch.tensor(labels)
    for _ in range(epochs):  # full batch: the features are computed once
        optimizer.zero_grad()
        nn.functional.cross_entropy(linear(x), target).backward()
        optimizer.step()
    return linear.eval()


def _scores(head: Head, x: torch.Tensor, actual: list[int]) -> dict[str, float]:
    probs = head.probs(x)
    truth = [bucket_of(n) for n in actual]
    log_loss = -float(np.mean([math.log(max(probs[i, b], 1e-9)) for i, b in enumerate(truth)]))
    s = from_probs("", probs, head.medians, actual)
    return {"log_loss": log_loss, "exact": s.exact, "within_one": s.within_one, "mae_tokens": s.mae_tokens}

