"""Train and evaluate the length predictor for one generator family, against baselines run alike.

    .venv/bin/python -m llmesh_lengthpred.train --family llama [--out DIR] [--epochs 3] [--seed 0]

Splits by prompt (20% held out), fine-tunes LoRA adapters and the head with a progress bar,
then prints one table on the held-out split: exact-bucket accuracy, ±1-bucket accuracy, mean
absolute error of the expected length in tokens, and calibration (mean confidence of the
predicted bucket against its accuracy, and the expected calibration error over 10 bins), for
the fine-tuned model and three baselines: always the training median, a regression of output
length on prompt length (log-log), and the frozen encoder with a linear head.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from llmesh.lengths import NUM_BUCKETS, bucket_medians, bucket_of

from . import data
from .model import MAX_PROMPT_TOKENS, LengthModel, encode, load_encoder, load_tokenizer, save


@dataclass
class Scores:
    name: str
    exact: float
    within_one: float
    mae_tokens: float
    confidence: float | None  # mean probability of the predicted bucket
    ece: float | None


def score(name: str, probs: np.ndarray | None, buckets: np.ndarray, expected: np.ndarray,
          actual: list[int]) -> Scores:
    truth = np.array([bucket_of(n) for n in actual])
    conf = ece = None
    if probs is not None:
        top = probs.max(1)
        hit = (buckets == truth).astype(float)
        conf = float(top.mean())
        bins = np.minimum((top * 10).astype(int), 9)
        ece = float(sum(abs(hit[bins == i].mean() - top[bins == i].mean()) * (bins == i).mean()
                        for i in range(10) if (bins == i).any()))
    return Scores(name, float((buckets == truth).mean()), float((abs(buckets - truth) <= 1).mean()),
                  float(np.abs(expected - np.array(actual)).mean()), conf, ece)


def from_probs(name: str, probs: np.ndarray, medians: list[float], actual: list[int]) -> Scores:
    return score(name, probs, probs.argmax(1), probs @ np.array(medians), actual)


def embed(model: LengthModel, batches: list[dict[str, torch.Tensor]]) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([model.features(b) for b in batches]).numpy()


def batches_of(tokenizer, examples: list[data.Example], size: int, max_tokens: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(0, len(examples), size):
        chunk = examples[i : i + size]
        batch = encode(tokenizer, [e.prompt for e in chunk], max_tokens)
        batch["label"] = torch.tensor([bucket_of(e.output_tokens) for e in chunk])
        out.append(batch)
    return out


def prompt_batches(tokenizer, examples: list[data.Example], size: int, seed: int,
                   max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """One row per prompt whose target is the distribution of buckets over the family's responses
    to it: the models of a family answer the same prompt at different lengths, and that spread
    is what a prompt-only predictor can learn."""
    by_prompt: dict[str, list[int]] = {}
    for e in examples:
        by_prompt.setdefault(e.prompt, []).append(bucket_of(e.output_tokens))
    prompts = sorted(by_prompt)
    random.Random(seed).shuffle(prompts)
    out = []
    for i in range(0, len(prompts), size):
        chunk = prompts[i : i + size]
        batch = encode(tokenizer, chunk, max_tokens)
        target = torch.zeros(len(chunk), NUM_BUCKETS)
        for row, prompt in enumerate(chunk):
            for b in by_prompt[prompt]:
                target[row, b] += 1 / len(by_prompt[prompt])
        batch["target"] = target
        out.append(batch)
    return out


def run(family: str, *, epochs: int = 3, seed: int = 0, limit_prompts: int | None = None, out: Path | None = None,
        batch_size: int = 16, lr: float = 1e-3, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        layers: int | None = None, quiet: bool = False) -> list[Scores]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer()
    examples = data.load(family, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                         limit_prompts)
    train, test = data.split_by_prompt(examples, 0.2, seed)
    random.Random(seed).shuffle(train)
    train_lengths = [e.output_tokens for e in train]
    actual = [e.output_tokens for e in test]
    medians = bucket_medians(train_lengths)
    if not quiet:
        print(f"{family}: {len(train)} training and {len(test)} held-out responses "
              f"({len({e.prompt for e in train})} / {len({e.prompt for e in test})} prompts) from "
              f"{sorted({e.source for e in examples})}")
    results = []

    # baseline 1: always the training median
    median = statistics.median(train_lengths)
    results.append(score("always the median", None, np.full(len(test), bucket_of(int(median))),
                         np.full(len(test), median), actual))
    # baseline 2: log-log regression on prompt length
    train_batches = batches_of(tokenizer, train, batch_size, max_prompt_tokens)
    test_batches = batches_of(tokenizer, test, 64, max_prompt_tokens)
    x_train = np.log1p(torch.cat([b["prompt_tokens"] for b in train_batches]).numpy())
    x_test = np.log1p(torch.cat([b["prompt_tokens"] for b in test_batches]).numpy())
    slope, intercept = np.polyfit(x_train, np.log1p(train_lengths), 1)
    predicted = np.expm1(slope * x_test + intercept)
    results.append(score("regression on prompt length", None, np.array([bucket_of(int(p)) for p in predicted]),
                         predicted, actual))
    # baseline 3: the encoder as it comes, with a linear head
    from sklearn.linear_model import LogisticRegression

    frozen = LengthModel(load_encoder(lora=False)).eval()
    labels = np.array([bucket_of(n) for n in train_lengths])
    head = LogisticRegression(max_iter=2000, C=1.0).fit(embed(frozen, train_batches), labels)
    probs = np.zeros((len(test), NUM_BUCKETS))
    probs[:, head.classes_] = head.predict_proba(embed(frozen, test_batches))
    results.append(from_probs("encoder, not fine-tuned, linear head", probs, medians, actual))

    # the predictor: LoRA adapters and the head, fine-tuned
    model = LengthModel(load_encoder(lora=True, layers=layers))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    per_prompt = prompt_batches(tokenizer, train, batch_size, seed, max_prompt_tokens)
    started = time.monotonic()
    for epoch in range(epochs):
        model.train()
        for batch in tqdm(per_prompt, desc=f"epoch {epoch + 1}/{epochs}", disable=quiet):
            optimizer.zero_grad()
            loss = -(batch["target"] * torch.log_softmax(model(batch), 1)).sum(1).mean()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        probs = torch.cat([torch.softmax(model(b), 1) for b in test_batches]).numpy()
    results.append(from_probs("MiniLM + LoRA, fine-tuned", probs, medians, actual))
    if out is not None:
        save(model, medians, {"family": family, "seed": seed, "epochs": epochs, "max_prompt_tokens": max_prompt_tokens,
                              "layers": layers,
                              "train_responses": len(train),
                              "scores": [vars(r) for r in results], "train_s": time.monotonic() - started}, out)
    if not quiet:
        print(table(family, len(test), results))
    return results


def table(family: str, held_out: int, results: list[Scores]) -> str:
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"held-out responses: {held_out} ({family} family)", "",
             "| predictor | exact bucket | ±1 bucket | MAE tokens | mean confidence | ECE |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.exact:.1%} | {r.within_one:.1%} | {r.mae_tokens:.0f} | {fmt(r.confidence)} | "
              f"{fmt(r.ece)} |" for r in results]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="llama", choices=sorted(data.FAMILIES))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-prompts", type=int, default=None, help="train on a slice: this many prompts")
    parser.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS,
                        help="the encoder reads this many leading tokens of a prompt (and its full length)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the encoder's first this many transformer layers (default: all six)")
    parser.add_argument("--out", type=Path, default=None, help="write the artifact (adapter, head, medians) here")
    args = parser.parse_args()
    run(args.family, epochs=args.epochs, seed=args.seed, limit_prompts=args.limit_prompts, out=args.out,
        max_prompt_tokens=args.max_prompt_tokens, layers=args.layers)
    if args.out is not None:
        print(json.dumps({"artifact": str(args.out)}))


if __name__ == "__main__":
    main()
