"""A request resumed on this engine: the output generated before it here (the prefill's first token, a
decode's before a migration or a failover) ends the engine's prompt. vLLM takes all of it as prompt;
what must count those tokens as output reads how many there are in `SamplingParams.extra_args`:
the penalties (llmesh.engine.penalties), a structured output's grammar (`resume_grammar`) and a seeded
request's random stream (`continue_seeded_streams`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from vllm.v1.request import Request

EARLIER_OUTPUT = "earlier_output"  # extra_args key: how many of the prompt's last tokens are earlier output
# extra_args key: how many of those its structured output's grammar reads, where not all (the rest reasoning:
# llmesh.engine.reasoning)
EARLIER_CONSTRAINED = "earlier_constrained"

log = logging.getLogger("llmesh.engine.resumed")


def earlier_output_args(generated: int, constrained: int | None = None) -> dict[str, Any]:
    """The extra_args entries of a request whose last `generated` prompt tokens are its earlier output, the
    last `constrained` of them read by its grammar (None: all)."""
    if not generated:
        return {}
    if constrained is None or constrained == generated:
        return {EARLIER_OUTPUT: generated}
    return {EARLIER_OUTPUT: generated, EARLIER_CONSTRAINED: constrained}


def earlier_output_count(extra_args: dict[str, Any] | None) -> int:
    """How many tokens a request generated before this engine (the end of its prompt here)."""
    return (extra_args or {}).get(EARLIER_OUTPUT, 0)


def earlier_output(prompt: list[int], extra_args: dict[str, Any] | None) -> list[int]:
    """The output a request generated before this engine: the end of its prompt here."""
    count = earlier_output_count(extra_args)
    return prompt[len(prompt) - count :] if count else []


def resume_grammar(request: Request) -> None:
    """Advance a structured-output request's grammar past its earlier output (what of it the grammar reads),
    as the monolithic engine's grammar stands after generating it: called once, before the request's first
    step on this engine (its grammar is compiled by then: vLLM schedules nothing of a request whose grammar
    is not)."""
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    structured = request.structured_output_request
    if structured is None or not request.sampling_params:
        return
    extra_args = request.sampling_params.extra_args or {}
    earlier = earlier_output(request.prompt_token_ids or [], extra_args)
    earlier = earlier[len(earlier) - extra_args.get(EARLIER_CONSTRAINED, len(earlier)) :]
    grammar = structured.grammar
    if not earlier or not isinstance(grammar, StructuredOutputGrammar):
        return
    if not grammar.accept_tokens(request.request_id, earlier):
        # Not expected: the engine before this one generated them under the same grammar.
        log.error("request %s: its grammar rejects its earlier output %s", request.request_id, earlier[:32])


def skip_draws(generator: torch.Generator, draws: int) -> None:
    """Move a request's seeded generator past `draws` of vLLM's sampling steps, a draw a step: on CPU
    one integer (`TopKTopPSampler.forward_cpu` seeds each step's noise from it); on CUDA an
    exponential per vocabulary entry, which moves the Philox offset by 4 (vLLM's own rewind of a
    discarded sample assumes as much). Not for `use_fp64_gumbel` or ROCm's sampler."""
    import torch

    if generator.device.type == "cpu":
        torch.randint(0, 2**31, (draws,), generator=generator, dtype=torch.long)
    else:
        generator.set_offset(generator.get_offset() + 4 * draws)


def continue_seeded_streams() -> None:
    """Make a seeded request resumed on this engine sample on from where the monolithic engine's random
    stream stands after its earlier output, not from the seed's start: vLLM makes a request's generator
    when its state is created in the model runner (once a request: a preempted one keeps it), so the
    generator skips the earlier output's draws there. Called by the vLLM plugin in the mesh's engines."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    made = CachedRequestState.__post_init__
    if getattr(made, "continues_seeded_streams", False):
        return

    def __post_init__(self: CachedRequestState) -> None:
        made(self)
        if self.generator is not None and self.sampling_params is not None:
            draws = earlier_output_count(self.sampling_params.extra_args)
            if draws:
                skip_draws(self.generator, draws)

    __post_init__.continues_seeded_streams = True  # type: ignore[attr-defined]
    CachedRequestState.__post_init__ = __post_init__  # type: ignore[method-assign]
