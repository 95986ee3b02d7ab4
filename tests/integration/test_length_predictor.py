"""The length models' data, training and evaluation on small slices of the real data
(../shared/data): every source loads, splits are by prompt, and on a held-out slice the
prompt-only model beats the constant and the remaining-length model beats the prompt-only one
once tokens are seen (directions, not tuned numbers: docs/benchmarks.md has the full runs)."""

from __future__ import annotations

import numpy as np
import pytest

from llmesh.wire.lengths import EDGES, NUM_BUCKETS, bucket_label, bucket_of
from llmesh_lengthpred import data
from llmesh_lengthpred.model import load_tokenizer
from llmesh_lengthpred.predictor import Predictor
from llmesh_lengthpred.regression import Hasher, bucket_probs
from llmesh_lengthpred.train import run, token_counter

pytestmark = pytest.mark.timeout(600)


def test_buckets_follow_uellm():
    assert [bucket_of(n) for n in (0, 7, 8, 15, 16, 1023, 1024, 2047, 2048, 10**6)] == [0, 0, 1, 1, 2, 7, 8, 8, 9, 9]
    assert NUM_BUCKETS == len(EDGES) + 1 == 10
    assert bucket_label(0) == "[0,8)" and bucket_label(9) == ">=2048"


def test_every_source_loads_with_its_generators_and_splits_by_prompt():
    count = token_counter(load_tokenizer())
    examples = data.load(count, limit_prompts=40, keep_text=True)
    by_source = {s: [e for e in examples if e.source == s] for s in data.SOURCES}
    assert all(len({e.prompt for e in rows}) == 40 for rows in by_source.values()), {
        s: len(r) for s, r in by_source.items()
    }
    assert len({e.generator for e in by_source["alpaca-eval"]}) == 30
    assert {e.family for e in by_source["gpteacher"]} == {"gpt-4"}
    assert {"o3-mini-2025-01-31", "gpt-4-0314"} <= {e.generator for e in by_source["arena-hard"]}
    for e in by_source["hh-rlhf"]:  # the dialogue so far is the prompt; its last answer is not in it
        assert e.prompt.startswith("Human:") and e.response and e.response not in e.prompt
    assert all(e.output_tokens == count([e.response])[0] > 0 for e in examples[::50])
    train, test = data.split_by_prompt(examples, 0.2, seed=0)
    assert train and test and not {e.prompt for e in train} & {e.prompt for e in test}


def test_families_of_generators():
    assert [
        data.family_of(g)
        for g in (
            "Meta-Llama-3-8B-Instruct",
            "gpt4_1106_preview",
            "gpt-4o-2024-05-13",
            "Mixtral-8x7B-Instruct-v0.1",
            "claude-3-opus-20240229",
            "Qwen2-72B-Instruct",
            "o3-mini-2025-01-31",
            "someone-new",
        )
    ] == ["llama", "gpt-4", "gpt-4", "mistral", "claude", "qwen", "o3", data.UNKNOWN]


def test_hashing_is_the_same_in_every_process():
    """Weights are stored by hashed index: a salted hash would scramble them in the next process."""
    assert Hasher().index("p:hello") == 227845 and Hasher(10).index("p:hello") == 227845 % 1024 == 517


def test_bucket_probabilities_sum_to_one_and_follow_the_estimate():
    probs = bucket_probs(np.log1p(np.array([3.0, 100.0, 5000.0])), 0.3)
    assert np.allclose(probs.sum(1), 1) and list(probs.argmax(1)) == [0, bucket_of(100), NUM_BUCKETS - 1]


def test_training_on_a_slice_beats_the_constant_and_refines_with_tokens_seen(tmp_path):
    report = run(
        limit_prompts=120,
        sources=("alpaca-eval", "gpteacher", "hh-rlhf"),
        leave_one_out=False,
        out=tmp_path / "model",
        quiet=True,
    )
    constant, ours = report["total"][:2]
    assert ours["mae_tokens"] < constant["mae_tokens"] and ours["within_one"] > constant["within_one"]
    assert ours["kendall_tau"] > 0.2 and constant["kendall_tau"] is None
    later = [r for r in report["remaining"] if r["seen"] >= 128 and r["rows"] >= 50]
    assert later and np.mean([r["mae_refined"] for r in later]) < np.mean([r["mae_prompt_only"] for r in later])
    # the artifact it wrote serves
    predictor = Predictor(tmp_path / "model", "test", "Meta-Llama-3-8B-Instruct")
    short, long = predictor.predict(
        [
            "What is 2 + 2? Answer with the number only.",
            "Write a detailed, multi-section essay on the history of Rome.",
        ],
        [40, 60],
    )
    assert short.expected_tokens < long.expected_tokens and short.informative
    (refined,) = predictor.predict_remaining(["Write a story."], ["Once upon a time"], [16], [5])
    assert refined.remaining_tokens > 0 and refined.generated_tokens == 5
