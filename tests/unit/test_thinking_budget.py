"""vLLM's `thinking_token_budget` on an engine that resumes a request (the decode after a prefill, a
migration, a failover) against the monolithic engine: vLLM's own budget state (`ThinkingBudgetStateHolder`)
driven step by step as its sampler drives it, over a model whose greedy choice is a function of the tokens
before it. The resumed engine's prompt ends with the output before it, from which vLLM's state counts the
reasoning so far; at every cut its tokens must be the rest of the monolithic engine's, for a model that opens
its reasoning once (a second `<think>` inside it: vLLM counts from the first, a resumed engine from the last)
and ends it with one token."""

import random
from types import SimpleNamespace

import pytest
import torch

VOCAB = 50
START, END = 40, 41  # <think>, </think>
PROMPT = [1, 7, 9, 3]


def model(context: list[int], seed: int) -> torch.Tensor:
    """Logits of a toy model: deterministic in the context, now and then opening its reasoning (not inside
    one) or closing it."""
    rng = random.Random(hash((seed, *context)))
    logits = torch.tensor([rng.random() for _ in range(VOCAB)])
    thinking = START in context and (END not in context or context[::-1].index(START) < context[::-1].index(END))
    logits[START] = logits[END] = -1.0
    if rng.random() < 0.12:
        logits[END if thinking else START] = 2.0
    return logits


def generate(prompt: list[int], steps: int, budget: int, end: list[int], seed: int) -> list[int]:
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    config = SimpleNamespace(reasoning_start_token_ids=[START], reasoning_end_token_ids=end)
    holder = ThinkingBudgetStateHolder(config, 4, 0, torch.device("cpu"), False)
    output: list[int] = []
    params = SimpleNamespace(thinking_token_budget=budget)
    holder.sync_batch(BatchUpdate(batch_size=1, removed=[], added=[(0, params, prompt, output)], moved=[]))
    for _ in range(steps):
        # (vLLM's sampler: the budget after penalties, on the committed output)
        holder.update_state([output], None)
        logits = holder.apply_to_logits(model(prompt + output, seed)[None], False, None)
        output.append(int(logits[0].argmax()))
    return output


@pytest.mark.parametrize("opened", [False, True])  # the template opens the reasoning in the prompt
def test_a_resumed_engine_keeps_the_monolithic_engines_thinking_budget_at_every_cut(opened):
    prompt = PROMPT + [START, 5] if opened else PROMPT
    checked = forced = 0
    for seed in range(12):
        for budget in (0, 1, 3, 8):
            whole = generate(prompt, 40, budget, [END], seed)
            forced += END in whole
            for cut in range(1, len(whole)):
                rest = generate(prompt + whole[:cut], len(whole) - cut, budget, [END], seed)
                assert rest == whole[cut:], (seed, budget, cut, whole)
                checked += 1
    assert forced and checked > 1000


def test_with_an_end_of_several_tokens_a_cut_inside_the_forced_end_parts_so_workers_refuse_such_a_budget():
    """vLLM's resumed state starts a forced end again from its first token (a canary: workers refuse a budget
    whose forced end is several tokens, `EngineWorker.generate`, until this passes the other way)."""
    end = [33, END]
    parted = 0
    for seed in range(12):
        whole = generate(PROMPT, 40, 1, end, seed)
        for cut in range(1, len(whole)):
            parted += generate(PROMPT + whole[:cut], len(whole) - cut, 1, end, seed) != whole[cut:]
    assert parted


def test_a_budget_whose_forced_end_is_several_tokens_is_refused_before_the_engine_runs():
    import asyncio

    from vllm import SamplingParams

    from llmesh.engine.worker import EngineWorker
    from llmesh.wire.errors import InvalidRequest

    worker = object.__new__(EngineWorker)  # what generate() reads of an engine's worker
    worker.forced_end_tokens, worker.engine = 2, None
    with pytest.raises(InvalidRequest, match="2 tokens") as refused:
        asyncio.run(anext(worker.generate([1, 2], SamplingParams(max_tokens=2, thinking_token_budget=3), "r")))
    assert refused.value.param == "thinking_token_budget"
