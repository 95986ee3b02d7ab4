"""A chat's structured output on a model with a reasoning parser: its engines hold the constraint until the
reasoning ends, as vLLM's engine does with `--reasoning-parser` (its `StructuredOutputManager`), and a request
resumed on an engine (its earlier output ends its prompt there: `llmesh.engine.resumed`) starts with its
grammar where the monolithic engine's stood after that output: fed the tokens past the reasoning's end.

vLLM's server gives its engine `reasoning_ended` (where the prompt ended the reasoning, or the request wants
no reasoning shown) and the template's variables for the engine's own parser (`reasoning_parser_kwargs`);
`ReasoningGates.engine_kwargs` gives the same, for the prompt and the earlier output the engine resumes after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmesh.wire.messages import ReasoningGate


def grammar_start(reasoner: Any, prompt: Sequence[int], output: Sequence[int]) -> int | None:
    """Where in `output` vLLM's engine starts feeding its grammar (None: the reasoning has not ended), with
    its checks: the prompt's end, then each token's as `accept_tokens` takes it (`_get_constraint_bounds` of
    one token: the end token itself content where a parser engine says the end is implicit, a tool call's
    start, say)."""
    from vllm.parser.engine.adapters import ParserEngineReasoningAdapter

    if reasoner.is_reasoning_end(list(prompt)):
        return 0
    engine_based = isinstance(reasoner, ParserEngineReasoningAdapter) and reasoner.reasoning_end_token_ids
    seen = list(prompt)
    for i, token in enumerate(output):
        seen.append(token)
        if engine_based and (end := reasoner.find_reasoning_end([token])) is not None:
            start = end.offset if end.implicit else end.offset + 1
        else:
            start = 1 if reasoner.is_reasoning_end_streaming(seen, [token]) else 2
        if start <= 1:  # (the grammar is fed the token from `start` on: the end is latched)
            return i + start
    return None


class ReasoningGates:
    """A worker's engine's reasoning parser (vLLM's `structured_outputs_config.reasoning_parser`)."""

    def __init__(self, parser_name: str, tokenizer: Any):
        from vllm.reasoning import ReasoningParserManager

        self.parser_class = ReasoningParserManager.get_reasoning_parser(parser_name)
        self.tokenizer = tokenizer

    def engine_kwargs(
        self, gate: ReasoningGate, prompt: Sequence[int], earlier: Sequence[int] = ()
    ) -> tuple[dict[str, Any], int]:
        """`generate()`'s reasoning_ended and reasoning_parser_kwargs for a request whose engine prompt is
        `prompt` then `earlier` (its output before this engine), and how many of `earlier`'s last tokens its
        grammar has read."""
        parser_kwargs = {"chat_template_kwargs": gate.chat_template_kwargs}
        reasoner = None if gate.from_start else self.parser_class(self.tokenizer, **parser_kwargs)
        start = 0 if reasoner is None else grammar_start(reasoner, prompt, earlier)
        kwargs = {"reasoning_ended": start is not None, "reasoning_parser_kwargs": parser_kwargs}
        return kwargs, 0 if start is None else len(earlier) - start
