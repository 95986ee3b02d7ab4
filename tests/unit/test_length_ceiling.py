"""The prompt-determined ceiling of length ranking follows how much a prompt's answers share."""

from __future__ import annotations

import numpy as np

from llmesh_lengthpred.ceiling import ceiling
from llmesh_lengthpred.data import Example


def examples(shared: float, seed: int = 0) -> list[Example]:
    """Two generators answer 400 prompts; log length = prompt effect * shared + own noise."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(400):
        effect = rng.normal()
        for generator, offset in (("a", 4.0), ("b", 5.0)):
            log_length = offset + shared * effect + (1 - shared) * rng.normal()
            out.append(Example(f"prompt {p}", int(np.expm1(log_length)), "s", generator))
    return out


def test_answers_set_by_the_prompt_reach_the_ceiling_and_independent_ones_do_not():
    same = ceiling("s", examples(shared=1.0))
    assert same.icc > 0.99 and same.ceiling_tau > 0.95 and same.others_tau_per_generator > 0.95
    independent = ceiling("s", examples(shared=0.0))
    assert independent.icc < 0.1 and independent.ceiling_tau < 0.25 and abs(independent.others_tau_per_generator) < 0.1
    half = ceiling("s", examples(shared=0.5))
    assert independent.ceiling_tau < half.ceiling_tau < same.ceiling_tau


def test_one_answer_a_prompt_has_no_ceiling():
    assert ceiling("s", [Example(f"p{i}", 10 + i, "s", "a") for i in range(50)]) is None
