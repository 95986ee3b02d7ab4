"""The length models: ridge regressions on the logarithm of the output length, over hashed words
of the text and a few numbers about it.

- `TotalModel`: from the prompt (and the generator's family) before anything is generated.
- `RemainingModel`: from the prompt and the text generated so far, the tokens still to come.

A regression on log-length orders requests (what shortest-first policies need), its exp is a
median estimate (what MAE rewards), and its residual spread on held-out data turns it into UELLM's
bucket probabilities. Hashed features need no vocabulary, so a model is two weight vectors and a
few numbers; a prediction is a sparse dot product, well under a millisecond of CPU.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import sparse
from scipy.special import ndtr

from llmesh.wire.lengths import EDGES, NUM_BUCKETS

from .data import UNKNOWN, family_of

HASH_BITS = 18
_WORD = re.compile(r"\w+|[^\w\s]")
_LOG_EDGES = np.log1p(np.array(EDGES, dtype=float))
TAIL_CHARS = 300  # the end of the generated text, read on its own: how an answer winds down


class Hasher:
    """Words and word pairs of a text, each namespace's counts scaled to unit length."""

    def __init__(self, bits: int = HASH_BITS):
        self.size = 1 << bits

    def index(self, token: str) -> int:
        return zlib.crc32(token.encode()) & (self.size - 1)  # stable across processes, unlike hash()

    def add(self, counts: dict[int, float], namespace: str, text: str) -> int:
        """Add `text`'s words and word pairs to `counts`; returns how many words it has."""
        words = _WORD.findall(text.lower())
        grams = [f"{namespace}{w}" for w in words] + [f"{namespace}{a} {b}" for a, b in zip(words, words[1:])]
        if not grams:
            return 0
        own: dict[int, float] = {}
        for gram in grams:
            i = self.index(gram)
            own[i] = own.get(i, 0.0) + 1.0
        norm = math.sqrt(sum(v * v for v in own.values()))
        for i, v in own.items():
            counts[i] = counts.get(i, 0.0) + v / norm
        return len(words)


def _numbers(text: str, words: int) -> list[float]:
    """What the words miss: size and shape (`words`: what `Hasher.add` counted in `text`)."""
    return [
        math.log1p(len(text)) / 8,
        math.log1p(text.count("\n")) / 4,
        math.log1p(words) / 8,
        float("```" in text),
        float("?" in text),
    ]


@dataclass
class Ridge:
    """y ≈ x·w + b on a sparse hashed part and a dense part, with the spread of its held-out residuals."""

    sparse_weights: np.ndarray
    dense_weights: np.ndarray
    bias: float
    sigma: float  # standard deviation of log-length residuals on data it was not fitted on
    info: dict = field(default_factory=dict)

    def predict(self, rows: sparse.csr_matrix, dense: np.ndarray) -> np.ndarray:
        return rows @ self.sparse_weights + dense @ self.dense_weights + self.bias

    @classmethod
    def fit(cls, rows: sparse.csr_matrix, dense: np.ndarray, y: np.ndarray, alpha: float) -> Ridge:
        from sklearn.linear_model import Ridge as SkRidge

        x = sparse.hstack([rows, sparse.csr_matrix(dense)], format="csr")
        model = SkRidge(alpha=alpha, solver="sparse_cg", max_iter=400, tol=1e-4).fit(x, y)
        w = model.coef_
        return cls(
            w[: rows.shape[1]].astype(np.float32),
            w[rows.shape[1] :].astype(np.float64),
            float(model.intercept_),
            float(np.std(y - model.predict(x))),
        )

    def save(self, path: Path) -> None:
        nonzero = np.flatnonzero(self.sparse_weights)
        np.savez_compressed(
            path.with_suffix(".npz"),
            index=nonzero.astype(np.int32),
            value=self.sparse_weights[nonzero],
            dense=self.dense_weights,
        )
        path.with_suffix(".json").write_text(
            json.dumps(
                {"bias": self.bias, "sigma": self.sigma, "size": len(self.sparse_weights), **self.info}, indent=2
            )
            + "\n"
        )

    @classmethod
    def load(cls, path: Path) -> Ridge:
        meta = json.loads(path.with_suffix(".json").read_text())
        arrays = np.load(path.with_suffix(".npz"))
        weights = np.zeros(meta.pop("size"), dtype=np.float32)
        weights[arrays["index"]] = arrays["value"]
        return cls(weights, arrays["dense"], meta.pop("bias"), meta.pop("sigma"), meta)


def bucket_probs(mu: np.ndarray, sigma: float | np.ndarray) -> np.ndarray:
    """P(length in each bucket) if log1p(length) ~ Normal(mu, sigma) (one sigma, or one a row)."""
    cdf = ndtr((_LOG_EDGES[None, :] - mu[:, None]) / np.reshape(sigma, (-1, 1)))
    return np.diff(np.concatenate([np.zeros((len(mu), 1)), cdf, np.ones((len(mu), 1))], axis=1), axis=1)


class TotalModel:
    """log1p(output tokens) from the prompt and the generator's family."""

    def __init__(self, ridge: Ridge | None = None, hasher: Hasher | None = None):
        self.ridge, self.hasher = ridge, hasher or Hasher()

    def features(self, prompts: list[str], generators: list[str]) -> tuple[sparse.csr_matrix, np.ndarray]:
        rows, dense = [], []
        for prompt, generator in zip(prompts, generators):
            counts: dict[int, float] = {}
            words = self.hasher.add(counts, "p:", prompt)
            family = family_of(generator)
            if family != UNKNOWN:
                counts[self.hasher.index(f"family:{family}")] = 1.0
                counts[self.hasher.index(f"generator:{generator.lower()}")] = 1.0
            rows.append(counts)
            dense.append(_numbers(prompt, words) + [float(family == UNKNOWN)])
        return _csr(rows, self.hasher.size), np.array(dense)

    def predict(self, prompts: list[str], generators: list[str]) -> np.ndarray:
        assert self.ridge is not None
        return self.ridge.predict(*self.features(prompts, generators))


class RemainingModel:
    """log1p(tokens still to come) from the prompt, the text generated so far and its length in
    tokens, and the prompt-only model's estimate `mu`."""

    def __init__(self, ridge: Ridge | None = None, hasher: Hasher | None = None):
        self.ridge, self.hasher = ridge, hasher or Hasher()

    def features(
        self, prompts: list[str], generated: list[str], generated_tokens: list[int]
    ) -> tuple[sparse.csr_matrix, np.ndarray]:
        """All but what depends on `mu` (`with_mu` adds it)."""
        rows, dense = [], []
        for prompt, text, n in zip(prompts, generated, generated_tokens):
            counts: dict[int, float] = {}
            prompt_words = self.hasher.add(counts, "p:", prompt)
            text_words = self.hasher.add(counts, "g:", text)
            self.hasher.add(counts, "t:", text[-TAIL_CHARS:])
            rows.append(counts)
            dense.append(_numbers(prompt, prompt_words) + _numbers(text, text_words) + [math.log1p(n) / 8])
        return _csr(rows, self.hasher.size), np.array(dense)

    @staticmethod
    def with_mu(dense: np.ndarray, mu: np.ndarray) -> np.ndarray:
        seen = dense[:, -1] * 8
        return np.hstack([dense, mu[:, None] / 8, (mu - seen)[:, None] / 8])

    def predict(
        self, prompts: list[str], generated: list[str], generated_tokens: list[int], mu: np.ndarray
    ) -> np.ndarray:
        assert self.ridge is not None
        rows, dense = self.features(prompts, generated, generated_tokens)
        return self.ridge.predict(rows, self.with_mu(dense, mu))


def _csr(rows: list[dict[int, float]], size: int) -> sparse.csr_matrix:
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.fromiter((i for r in rows for i in r), dtype=np.int32, count=indptr[-1])
    values = np.fromiter((v for r in rows for v in r.values()), dtype=np.float32, count=indptr[-1])
    return sparse.csr_matrix((values, indices, indptr), shape=(len(rows), size))


assert NUM_BUCKETS == len(EDGES) + 1
