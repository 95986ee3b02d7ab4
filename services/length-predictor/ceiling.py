"""How much of a response's length its prompt determines, source by source: the most any
predictor that reads only the prompt can rank.

    .venv/bin/python -m llmesh_lengthpred.ceiling

Where a prompt has several answers (AlpacaEval: 30 generators; Arena-Hard: up to 5; HH-RLHF: two
samples of the same model), the answers' log lengths, each less its generator's mean, split into
a part shared by the prompt's answers and a part that varies between them. The shared part's
share of the variance (the intra-class correlation, ICC) is what a perfect prompt-only predictor
explains; its correlation with one answer is sqrt(ICC), and Kendall's tau follows from that for
normal variables (2/pi * arcsin). Printed beside it, without that assumption: tau within each
generator between an answer and the mean of the other answers to its prompt (a noisy stand-in
for the perfect predictor, that needs no such assumption). The ceiling counts what depends on the
pair of prompt and generator as noise, so for a set of several generators it is a floor of the
true ceiling; for one generator sampled twice (HH-RLHF) it is the ceiling itself.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from . import data
from .model import load_tokenizer
from .train import token_counter


@dataclass(frozen=True)
class Ceiling:
    source: str
    responses: int  # those whose prompt has another answer
    prompts: int
    icc: float
    ceiling_tau: float
    others_tau_per_generator: float


def ceiling(source: str, examples: list[data.Example]) -> Ceiling | None:
    """None when no prompt of `examples` has two answers."""
    generator_mean = {
        g: np.mean([np.log1p(e.output_tokens) for e in examples if e.generator == g])
        for g in {e.generator for e in examples}
    }
    answers: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for e in examples:
        answers[e.prompt].append((e.generator, np.log1p(e.output_tokens) - generator_mean[e.generator]))
    groups = [np.array([v for _, v in a]) for a in answers.values() if len(a) >= 2]
    if not groups:
        return None
    values = np.concatenate(groups)
    n_mean = values.size / len(groups)  # one-way ANOVA, ICC(1)
    between = sum(g.size * (g.mean() - values.mean()) ** 2 for g in groups) / (len(groups) - 1)
    within = sum(((g - g.mean()) ** 2).sum() for g in groups) / (values.size - len(groups))
    icc = max(0.0, (between - within) / (between + (n_mean - 1) * within))

    others, actual, generators = [], [], []
    for a in answers.values():
        if len(a) < 2:
            continue
        total = sum(v for _, v in a)
        for g, v in a:
            others.append((total - v) / (len(a) - 1))
            actual.append(v)
            generators.append(g)
    others_arr, actual_arr, gen_arr = np.array(others), np.array(actual), np.array(generators)
    per_generator = [
        (m.sum(), stats.kendalltau(others_arr[m], actual_arr[m]).statistic)
        for g in set(generators)
        if (m := gen_arr == g).sum() >= 20
    ]
    return Ceiling(
        source,
        values.size,
        len(groups),
        float(icc),
        float(2 / np.pi * np.arcsin(np.sqrt(icc))),
        float(sum(n * t for n, t in per_generator) / sum(n for n, _ in per_generator)),
    )


def main() -> None:
    examples = data.load(token_counter(load_tokenizer()))
    print("| source | responses | prompts | ICC (prompt's share) | tau ceiling | tau, other answers' mean |")
    print("|---|---|---|---|---|---|")
    for source in data.SOURCES:
        c = ceiling(source, [e for e in examples if e.source == source])
        if c is None:
            print(f"| {source} | one answer a prompt: not measurable | | | | |")
        else:
            print(
                "| {source} | {responses} | {prompts} | {icc:.2f} | {ceiling_tau:.2f} | "
                "{others_tau_per_generator:.2f} |".format(**asdict(c))
            )


if __name__ == "__main__":
    main()
