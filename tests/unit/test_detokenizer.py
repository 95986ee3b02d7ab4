"""A decode leg's text continues the stream exactly: whatever token it resumes after (one inside a
multi-byte character included), what the legs show adds up to one detokenizer's text."""

import random

import pytest
from transformers import AutoTokenizer

from llmesh.engine.detokenizer import ContinuedText, echoed_prompt
from llmesh.engine.models import build_tokenizer
from llmesh.wire.messages import PrefillRequest, SamplingOptions


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_a_stream_split_anywhere_shows_the_same_text(tokenizer):
    rng = random.Random(7)
    prompt = [rng.randrange(10, tokenizer.vocab_size) for _ in range(40)]
    partial = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd"]  # one byte of a character
    assert partial
    outputs = [rng.randrange(10, tokenizer.vocab_size) for _ in range(120)]  # past the 64-token window and
    # the tokens a resumed leg replays
    outputs += tokenizer.encode(" end", add_special_tokens=False)  # nothing held back at the end
    outputs[4:4] = [partial[0]]  # a character's first byte, never completed
    for at in (12, 50, 90, 110):  # whole multi-byte characters, some where a resumed leg's replay begins
        outputs[at:at] = list(tokenizer.encode("é ü 日本", add_special_tokens=False))
    whole = ContinuedText(tokenizer, prompt, []).feed(outputs)
    assert whole == tokenizer.decode(outputs)
    for k in range(len(outputs)):
        shown = ContinuedText(tokenizer, prompt, []).feed(outputs[:k])
        assert shown + ContinuedText(tokenizer, prompt, outputs[:k]).feed(outputs[k:]) == whole, k


def test_special_tokens_show_no_text(tokenizer):
    text = ContinuedText(tokenizer, [5, 6], [])
    assert text.feed([tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|system|>")]) == ""
    assert text.feed(tokenizer.encode(" hello", add_special_tokens=False)) == " hello"


def test_special_tokens_text_adds_up_to_vllms_detokenizers_when_asked(tokenizer):
    """skip_special_tokens false: the legs' texts, split anywhere, add up to what vLLM's detokenizer (a
    tokenizers DecodeStream primed with the prompt) shows."""
    from tokenizers.decoders import DecodeStream

    rng = random.Random(3)
    specials = tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>", "</s>"])
    prompt = [rng.randrange(10, tokenizer.vocab_size) for _ in range(20)]
    outputs = [rng.choice(specials) if rng.random() < 0.3 else rng.randrange(10, 400) for _ in range(60)]
    stream = DecodeStream(ids=prompt, skip_special_tokens=False)
    expected = "".join(stream.step(tokenizer.backend_tokenizer, t) or "" for t in outputs)
    assert "<|user|>" in expected
    for k in range(len(outputs)):
        shown = ContinuedText(tokenizer, prompt, [], skip_special_tokens=False).feed(outputs[:k])
        rest = ContinuedText(tokenizer, prompt, outputs[:k], skip_special_tokens=False).feed(outputs[k:])
        assert shown + rest == expected, k


def test_logprob_texts_of_a_resumed_leg_are_those_of_one_stream(tokenizer):
    """vLLM completes a byte token's text with the output before it: a leg resumed after any token
    names every candidate as one engine running the whole stream would."""
    from vllm.logprobs import Logprob

    from llmesh.engine.detokenizer import logprob_steps

    outputs = tokenizer.encode(" a é b 日本 c", add_special_tokens=False)
    candidates = [[token, (token * 7 + 3) % tokenizer.vocab_size] for token in outputs]  # sampled first
    steps = [{token: Logprob(-1.0 - i) for i, token in enumerate(ids)} for ids in candidates]
    whole = logprob_steps(tokenizer, steps, [])
    alone = [tokenizer.decode([token]) for token in outputs]
    assert [step[0][2] for step in whole] != alone  # some text needs the tokens before it
    assert "".join(step[0][2] for step in whole) == tokenizer.decode(outputs)
    for k in range(1, len(outputs)):
        assert logprob_steps(tokenizer, steps[:k], []) + logprob_steps(tokenizer, steps[k:], outputs[:k]) == whole, k


def test_added_tokens_without_spaces_between_them_add_up_to_vllms_fast_detokenizers(tokenizer):
    """skip_special_tokens and spaces_between_special_tokens false: the legs' texts, split anywhere, add up to
    what vLLM's detokenizer for fast tokenizers shows (an added token after another: its own text alone). With a
    decoder that joins tokens with spaces (WordPiece's), which puts one between two added tokens too."""
    import copy
    from types import SimpleNamespace

    from tokenizers import decoders
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    spacing = copy.deepcopy(tokenizer)
    spacing.backend_tokenizer.decoder = decoders.WordPiece()
    rng = random.Random(5)
    specials = spacing.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>", "</s>"])
    prompt = [rng.randrange(10, spacing.vocab_size) for _ in range(20)] + specials[:1]
    outputs = [rng.choice(specials) if rng.random() < 0.5 else rng.randrange(10, 400) for _ in range(60)]
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    vllms = FastIncrementalDetokenizer(
        spacing, SimpleNamespace(sampling_params=params, prompt_token_ids=prompt, request_id="r")
    )
    expected = "".join(vllms.decode_next(t) for t in outputs)
    assert "><|" in expected and "> <|" in ContinuedText(spacing, prompt, [], False).feed(outputs)
    for k in range(len(outputs)):
        shown = ContinuedText(spacing, prompt, [], False, False).feed(outputs[:k])
        assert shown + ContinuedText(spacing, prompt, outputs[:k], False, False).feed(outputs[k:]) == expected, k


def test_an_echo_shows_the_prompt_as_given_before_any_truncation(tokenizer):
    def request(echo, **prompt):
        return PrefillRequest(request_id="r", model="m", sampling=SamplingOptions(echo=echo), deadline=0, **prompt)

    ids = tokenizer.encode("one two three", add_special_tokens=False)
    assert echoed_prompt(tokenizer, request(False, prompt="one two"), ids) is None
    assert echoed_prompt(tokenizer, request(True, prompt=" one  two"), ids[1:]) == " one  two"  # as typed
    assert echoed_prompt(tokenizer, request(True, prompt_token_ids=ids), ids[1:]) == tokenizer.decode(ids)  # whole
