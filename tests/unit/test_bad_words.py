"""Bad words over a request's whole output (llmesh.engine.bad_words): wherever the output is split between
the engines that generated it (the earlier part in the resumed engine's prompt), the tokens banned are those
vLLM's rule bans on one engine holding all of it."""

import random

import torch

from llmesh.engine.bad_words import OutputBadWords, _Banning, banned


def test_a_resumed_engine_bans_what_one_engine_with_the_whole_output_bans():
    from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch

    rng = random.Random(11)
    vocab = 12  # few tokens: words' prefixes occur
    cases = 0
    for _ in range(300):
        words = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 4))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        logits = torch.zeros(vocab)
        _apply_bad_words_single_batch(logits, words, output)
        expected = {t for t in range(vocab) if logits[t] == float("-inf")}
        for split in range(len(output) + 1):  # output[:split] generated on engines before this one
            assert set(banned(words, output[:split], output[split:])) == expected, (words, output, split)
            cases += 1
    assert cases > 1000


def test_the_processor_sets_a_banned_tokens_logit_to_minus_infinity_in_its_row_alone():
    processor = OutputBadWords.__new__(OutputBadWords)
    processor.requests = {1: _Banning(words=[[3], [5, 7]], earlier=[5], output=[])}
    logits = torch.zeros(2, 10)
    processor.apply(logits)
    assert logits[0].isinf().sum() == 0
    assert {t for t in range(10) if logits[1, t] == float("-inf")} == {3, 7}
