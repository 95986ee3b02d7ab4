"""vLLM's `bad_words` over a request's whole output, on whichever engine runs it.

vLLM bans a bad word's last token where the output so far ends with the rest of the word
(`_apply_bad_words_single_batch`), on the engine's own output; the output a request generated on another
engine (the prefill's first token, a decode before a migration) is the prompt of the engine that continues
it. So a request's bad words are banned here instead, over its earlier output (llmesh.engine.resumed) and
this engine's, by vLLM's rule, and none are left to vLLM. vLLM bans them before its other logits processors,
and custom ones like this run after its built-in ones (min_tokens, logit_bias): a banned token's -inf is the
same either way.
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

BAD_WORDS = "bad_words"  # extra_args key: each bad word's token ids, as vLLM tokenizes them


def bad_words_args(words: list[str], tokenizer: Any) -> dict[str, Any]:
    """The extra_args entry of a request with `words` banned: their token ids, as vLLM's engine makes them
    (each word with and without a leading space), with vLLM's errors."""
    from vllm import SamplingParams

    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(tokenizer)
    return {BAD_WORDS: params.bad_words_token_ids}


def banned(words: Sequence[Sequence[int]], earlier: Sequence[int], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word after `earlier` then `output` (vLLM's rule, over both)."""
    length, longest = len(earlier) + len(output), max(map(len, words))
    recent = [*earlier[-longest:], *output[-longest:]][-longest:]
    out = []
    for word in words:
        if len(word) <= length + 1 and list(word[:-1]) == recent[len(recent) - len(word) + 1 :]:
            out.append(word[-1])
    return out


@dataclass
class _Banning:
    words: list[list[int]]
    earlier: list[int]  # the output generated before this engine (its prompt's last tokens)
    output: Sequence[int]  # this engine's output: vLLM's own list, growing every step


class OutputBadWords(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.requests: dict[int, _Banning] = {}  # by the request's row in the batch

    def is_argmax_invariant(self) -> bool:
        return False  # a banned token may be the likeliest

    def _added(self, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _Banning | None:
        words = (params.extra_args or {}).get(BAD_WORDS)
        return _Banning(words, earlier_output(prompt or [], params.extra_args), output) if words else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, self._added)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, request in self.requests.items():
            for token in banned(request.words, request.earlier, request.output):
                logits[row, token : token + 1] = float("-inf")  # (a slice: no host sync, as vLLM assigns it)
        return logits
