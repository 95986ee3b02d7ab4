"""Where a structured output's grammar starts on a model with a reasoning parser: `grammar_start` against vLLM
0.32's own engine-side checks (`StructuredOutputManager._get_constraint_bounds` as `accept_tokens` runs them,
a token a step), for a request resumed after any part of its output."""

from types import SimpleNamespace

import pytest

from llmesh.engine.models import build_tokenizer
from llmesh.engine.reasoning import ReasoningGates, grammar_start
from llmesh.engine.resumed import EARLIER_CONSTRAINED, EARLIER_OUTPUT, earlier_output_args
from llmesh.wire.messages import ReasoningGate

# outputs of a reasoning model: reasoning that ends and content, reasoning never ended, an end at once,
# content then a stray end
OUTPUTS = ['Two and two.</think>{"a": 4}', "Still thinking", "</think>{}", "{} and </think> again"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from vllm.tokenizers import get_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return get_tokenizer(str(path))


def vllms_start(manager_reasoner, tokenizer, kwargs, prompt, output) -> int | None:
    """Where vLLM's engine first feeds its grammar a token of `output` (None: never), generating it a token a
    step: `accept_tokens`' bounds of each new token, the end latched once found."""
    from vllm.v1.structured_output import StructuredOutputManager

    manager = object.__new__(StructuredOutputManager)  # (what `_get_constraint_bounds` reads of it)
    manager.enable_in_reasoning, manager.reasoner_cls, manager.tokenizer = False, manager_reasoner, tokenizer
    structured = SimpleNamespace(reasoning_ended=None, reasoner=None, reasoning_parser_kwargs=kwargs)
    request = SimpleNamespace(structured_output_request=structured, prompt_token_ids=prompt, all_token_ids=list(prompt))
    for i, token in enumerate(output):
        request.all_token_ids.append(token)
        start, _ = manager._get_constraint_bounds(request, [token], spec_tokens_committed=True)
        if start <= 1:  # (accept_tokens feeds the grammar tokens[start:] and latches the end)
            return i + start
    return None


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("thinking", [True, False])
def test_the_grammar_starts_where_vllms_engine_starts_it_after_any_earlier_output(tokenizer, name, thinking):
    from vllm.reasoning import ReasoningParserManager

    reasoner = ReasoningParserManager.get_reasoning_parser(name)
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
    messages = [{"role": "user", "content": "Two and two?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=thinking)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    starts = []
    for output in OUTPUTS:
        ids = tokenizer.encode(output, add_special_tokens=False)
        expected = vllms_start(reasoner, tokenizer, kwargs, prompt, ids)
        assert grammar_start(reasoner(tokenizer, **kwargs), prompt, ids) == expected, output
        starts.append(expected)
        gates = ReasoningGates(name, tokenizer)
        for done in range(1, len(ids) + 1):  # resumed after `done` tokens: what of them its grammar has read
            engine, constrained = gates.engine_kwargs(
                ReasoningGate(chat_template_kwargs=kwargs["chat_template_kwargs"]), prompt, ids[:done]
            )
            ended = expected is not None and expected <= done
            assert engine == {"reasoning_ended": ended, "reasoning_parser_kwargs": kwargs}
            assert constrained == (done - expected if ended else 0)
    if thinking:  # (the checks saw each case: an end past reasoning, none, an end first)
        assert starts[1] is None and starts[2] == 1 and starts[0] > 1
    else:  # the prompt ended the reasoning
        assert starts == [0] * len(OUTPUTS)


def test_a_gate_from_the_start_has_the_grammar_read_every_earlier_token(tokenizer):
    gates = ReasoningGates("deepseek_r1", tokenizer)
    engine, constrained = gates.engine_kwargs(ReasoningGate(from_start=True), [1, 2], [5, 6, 7])
    assert engine == {"reasoning_ended": True, "reasoning_parser_kwargs": {"chat_template_kwargs": {}}}
    assert constrained == 3
    assert earlier_output_args(3, 3) == {EARLIER_OUTPUT: 3} == earlier_output_args(3)
    assert earlier_output_args(3, 1) == {EARLIER_OUTPUT: 3, EARLIER_CONSTRAINED: 1} and earlier_output_args(0, 0) == {}
