"""OpenAI's presence and frequency penalties over a request's whole output, on whichever engine runs it.

vLLM counts them on the output alone (`apply_penalties`), and the output a request generated on another
engine (the prefill's first token, a decode before a migration) is the prompt of the engine that
continues it. So a request with either penalty has every penalty applied here instead, knowing how many
of its prompt's last tokens were generated (llmesh.engine.resumed), with vLLM's
own operations in vLLM's order (repetition, frequency, presence), and none left to vLLM's sampler.
vLLM runs custom logits processors after its own (min_tokens, logit_bias) and before its penalties,
where these would have run: the logits are the monolithic engine's bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from llmesh.engine.resumed import earlier_output

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

OUTPUT_PENALTIES = "output_penalties"  # extra_args key: {"repetition", "frequency", "presence"}


def output_penalties(repetition: float, frequency: float, presence: float) -> dict[str, Any]:
    """The extra_args entry of a request whose penalties are applied here."""
    return {OUTPUT_PENALTIES: {"repetition": repetition, "frequency": frequency, "presence": presence}}


@dataclass
class _Penalized:
    repetition: torch.Tensor  # [1] float32, as vLLM keeps a batch's penalties
    frequency: torch.Tensor  # [1, 1]
    presence: torch.Tensor  # [1, 1]
    prompt_mask: torch.Tensor  # [1, vocab]: the tokens of the engine's prompt (the earlier output at its end)
    earlier_counts: torch.Tensor  # [1, vocab]: of the output generated before this engine
    output: Sequence[int]  # this engine's output: vLLM's own list, growing every step


class OutputPenalties(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.vocab = vllm_config.model_config.get_vocab_size()
        self.requests: dict[int, _Penalized] = {}  # by the request's row in the batch

    def is_argmax_invariant(self) -> bool:
        return False  # penalties change which token is likeliest

    def _added(self, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _Penalized | None:
        """A request's penalties and what of them is fixed for its life here, on the device once."""
        spec = (params.extra_args or {}).get(OUTPUT_PENALTIES)
        if spec is None:
            return None
        prompt = prompt or []
        earlier = earlier_output(prompt, params.extra_args)
        return _Penalized(
            torch.tensor([spec["repetition"]], dtype=torch.float32).to(self.device),
            torch.tensor([[spec["frequency"]]], dtype=torch.float32).to(self.device),
            torch.tensor([[spec["presence"]]], dtype=torch.float32).to(self.device),
            _bin_counts(prompt, self.vocab, self.device) > 0,
            _bin_counts(earlier, self.vocab, self.device),
            output,
        )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, self._added)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        from vllm._custom_ops import apply_repetition_penalties

        for row, request in self.requests.items():
            counts = request.earlier_counts + _bin_counts(request.output, self.vocab, self.device)
            view = logits[row : row + 1]
            apply_repetition_penalties(view, request.prompt_mask, counts > 0, request.repetition)
            view -= request.frequency * counts  # (vLLM's apply_penalties, a row at a time)
            view -= request.presence * (counts > 0)
        return logits


def _bin_counts(token_ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[1, vocab] counts of each token, as vLLM's get_token_bin_counts_and_mask makes them."""
    tokens = torch.tensor([list(token_ids)], dtype=torch.long).to(device, non_blocking=True)
    counts = torch.zeros((1, vocab + 1), dtype=torch.long, device=device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    return counts[:, :vocab]
