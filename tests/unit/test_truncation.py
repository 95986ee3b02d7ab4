"""A prompt's truncation (`truncate_prompt_tokens`, `truncation_side`) in the worker against vLLM's server's
own (`TokenizeParams`: its encode arguments, then its cut after tokenization): text and token prompts, with
and without special tokens, either side or the tokenizer's, -1, 0 and lengths around the prompt's."""

import asyncio

import pytest
from transformers import AutoTokenizer

from llmesh.engine.models import build_tokenizer
from llmesh.engine.prompts import PromptRenderer
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import PrefillRequest, SamplingOptions

CONTEXT = 64
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods to hide."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


class Renderer(PromptRenderer):
    def prompt_token_ids(self, req: PrefillRequest) -> list[int]:  # type: ignore[override]
        return asyncio.run(super().prompt_token_ids(req))


def worker(tokenizer) -> Renderer:
    return Renderer(tokenizer, CONTEXT)


@pytest.mark.parametrize("tokenizer_side", ["left", "right"])
@pytest.mark.parametrize("side", [None, "left", "right"])
def test_prompts_are_truncated_as_vllms_server_truncates_them(tokenizer, tokenizer_side, side):
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.params import TokenizeParams

    tokenizer.truncation_side = tokenizer_side
    ours = worker(tokenizer)
    long_text = " ".join([TEXT] * 4)  # past the context
    cases = 0
    for text in (TEXT, long_text):
        length = len(tokenizer.encode(text))
        for truncate in (None, -1, 0, 1, 5, length - 1, length, length + 3, CONTEXT):
            for max_tokens in (None, 16):
                for special in (True, False):
                    fields = {
                        "request_id": "r",
                        "model": "m",
                        "deadline": 0,
                        "add_special_tokens": special,
                        "truncate_prompt_tokens": truncate,
                        "truncation_side": side,
                        "sampling": SamplingOptions(max_tokens=max_tokens),
                    }
                    full = tokenizer.encode(text, add_special_tokens=special)
                    try:
                        params = TokenizeParams(
                            max_total_tokens=CONTEXT,
                            max_output_tokens=max_tokens or 0,
                            truncate_prompt_tokens=truncate,
                            truncation_side=side,
                            add_special_tokens=special,
                        )
                    except VLLMValidationError:  # more than the context: the worker refuses it too
                        with pytest.raises(InvalidRequest, match="cannot be greater than max_model_len"):
                            ours.prompt_token_ids(PrefillRequest(**fields, prompt=text))
                        continue
                    for prompt, theirs in (
                        ({"prompt": text}, tokenizer.encode(text, **params.get_encode_kwargs())),
                        ({"prompt_token_ids": full}, full),
                    ):
                        try:
                            expected = params.apply_post_tokenization(tokenizer, {"prompt_token_ids": theirs})
                        except VLLMValidationError:  # over the context: the worker's max_tokens check refuses it
                            assert len(ours.prompt_token_ids(PrefillRequest(**fields, **prompt))) > CONTEXT
                            continue
                        got = ours.prompt_token_ids(PrefillRequest(**fields, **prompt))
                        assert got == expected["prompt_token_ids"], (prompt.keys(), truncate, max_tokens, special)
                        cases += 1
    assert cases > 100


def test_a_truncation_longer_than_the_context_is_refused_as_vllm_refuses_it(tokenizer):
    req = PrefillRequest(
        request_id="r",
        model="m",
        deadline=0,
        prompt=TEXT,
        truncate_prompt_tokens=CONTEXT + 1,
        sampling=SamplingOptions(),
    )
    with pytest.raises(InvalidRequest, match="cannot be greater than max_model_len") as raised:
        worker(tokenizer).prompt_token_ids(req)
    assert raised.value.param == "truncate_prompt_tokens"
