"""The text of a decode that continues a stream another engine (or leg) began.

vLLM's detokenizer treats the engine's prompt as text already shown; a resumed decode's prompt
ends with the outputs streamed so far, and when those end inside a character (a byte-fallback
token whose character the next token completes) vLLM primes its stream with the whole prompt and
emits the whole prompt's text as the first delta (vllm-project/vllm#48853), and the held-back
bytes are lost either way.
So a decode leg asks vLLM for tokens only and makes its text here: primed with the tokens before the
last few outputs already streamed, then those outputs (their text discarded: the client has it, or
holds it back exactly as this would), every new token yields what a single detokenizer over the whole
stream would have shown (vLLM's incremental algorithm: text is released once it does not end in
an incomplete character).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llmesh.wire.messages import LogprobSteps, PrefillRequest

CONTEXT_TOKENS = 5  # before the outputs: enough for tokenizers that merge a space into a word
LOGPROB_CONTEXT = 4  # output tokens before a candidate that vLLM completes its text with (a character's bytes)
REPLAYED_TOKENS = 24  # of the outputs streamed so far, replayed to learn what the stream holds back: a
# character is at most 4 byte tokens, so a few characters find the last place text was released
# (replaying the whole stream made a resume's cost on the event loop grow with the stream's length)


class ContinuedText:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        streamed_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        # skipped, as vLLM skips them: the tokenizer's named ones and any added token marked special
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special = (
            set(getattr(tokenizer, "all_special_ids", ()) or ()) | {i for i, t in added.items() if t.special}
            if skip_special_tokens
            else set()
        )
        # shown, where their spaces are not: an added token's text after another's is its own alone, without the
        # space the stream puts before it (vLLM's fast detokenizer)
        self._added = (
            {} if skip_special_tokens or spaces_between_special_tokens else {i: t.content for i, t in added.items()}
        )
        self._after_added = False
        replayed = streamed_ids[-REPLAYED_TOKENS:]
        earlier = streamed_ids[: len(streamed_ids) - len(replayed)]
        self._tokens = self._pieces([*prompt_ids[-CONTEXT_TOKENS:], *earlier[-CONTEXT_TOKENS:]][-CONTEXT_TOKENS:])
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        for token_id in replayed:
            self.step(token_id)

    def _pieces(self, token_ids: Sequence[int]) -> list[str]:
        kept = [t for t in token_ids if t not in self._special]
        return list(self._tokenizer.convert_ids_to_tokens(kept)) if kept else []

    def step(self, token_id: int) -> str:
        """The text `token_id` releases (empty while a character is incomplete, or for a special token)."""
        text = self._step(token_id)
        if self._added:
            added = self._added.get(token_id)
            if added is not None and self._after_added:
                text = added
            self._after_added = added is not None
        return text

    def _step(self, token_id: int) -> str:
        pieces = self._pieces([token_id])
        if not pieces:
            return ""
        self._tokens += pieces
        to_string = self._tokenizer.convert_tokens_to_string
        shown = to_string(self._tokens[self._prefix_offset : self._read_offset])
        text = to_string(self._tokens[self._prefix_offset :])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        if self._prefix_offset > 64:  # keep a short window
            del self._tokens[: self._prefix_offset]
            self._prefix_offset, self._read_offset = 0, self._read_offset - self._prefix_offset
        return text[len(shown) :]

    def feed(self, token_ids: Sequence[int]) -> str:
        return "".join(self.feed_each(token_ids))

    def feed_each(self, token_ids: Sequence[int]) -> list[str]:
        """The text each of `token_ids` releases, in order."""
        return [self.step(t) for t in token_ids]


def logprob_steps(tokenizer: Any, steps: Sequence[Mapping[int, Any]], output_before: Sequence[int]) -> LogprobSteps:
    """vLLM's logprobs of new tokens (a dict a token, the sampled one first) with each candidate's text as
    a monolithic engine's would be: vLLM decodes a candidate alone, or, where that ends in an incomplete
    character, with the few output tokens before it, which a resumed engine does not have;
    `output_before` is the output generated before these steps."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    texts = LogprobsProcessor(tokenizer, None, None, None, None, None)  # for its _verify_tokens alone
    context, out = list(output_before[-LOGPROB_CONTEXT:]), []
    for step in steps:
        ids = list(step)
        # (vLLM's own correction of a candidate against the sampled tokens before it, called as vLLM calls it)
        decoded = texts._verify_tokens(convert_ids_list_to_tokens(tokenizer, ids), ids, context_token_ids=context)
        out.append([(token, step[token].logprob, text) for token, text in zip(ids, decoded)])
        context = [*context, ids[0]][-LOGPROB_CONTEXT:]
    return out


def echoed_prompt(tokenizer: Any, req: PrefillRequest, token_ids: Sequence[int]) -> str | None:
    """A request's prompt text as its echo shows it (None without an echo): as given, else decoded as vLLM's
    server decodes token prompts, as given, before any truncation (`token_ids`: the prompt as tokenized)."""
    if not req.sampling.echo:
        return None
    return tokenizer.decode(req.prompt_token_ids or token_ids) if req.prompt is None else req.prompt


def prompt_logprob_fields(
    tokenizer: Any, token_ids: Sequence[int], prompt_logprobs: Sequence[Mapping[int, Any] | None] | None
) -> dict[str, Any]:
    """A first `TokenDelta`'s `prompt_logprobs` and `prompt_ranks` from vLLM's prompt logprobs: each step's
    prompt token first, then the likeliest (texts are vLLM's, the whole prompt being on the engine), and the
    rank of each step's prompt token; the first token's, which has none, with logprob and rank None."""
    if not prompt_logprobs:
        return {}
    first = token_ids[0]
    steps = [step for step in prompt_logprobs[1:] if step is not None]
    return {
        "prompt_logprobs": [[(first, None, tokenizer.decode(first))]]
        + [[(token, logprob.logprob, logprob.decoded_token) for token, logprob in step.items()] for step in steps],
        "prompt_ranks": [None] + [next(iter(step.values())).rank for step in steps],
    }
