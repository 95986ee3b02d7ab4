"""A worker's prompts as token ids: a chat through the model's chat template, a text through its
tokenizer, token ids checked; truncated as vLLM's server truncates them. Generation and /tokenize
render through the same code (`PromptRenderer`), so a tokenized prompt is the one its generation gets."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jinja2

from llmesh.engine.detokenizer import echoed_prompt
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import ChatMessage, PrefillRequest, TokenizePrompt

T = TypeVar("T")
# a prompt's text longer than this is rendered off the event loop (about 15 ms of a CPU's tokenizing)
INLINE_PROMPT_CHARS = 16_384
INLINE_TOKEN_IDS = 4_096  # and token ids more than this are decoded (or listed as strings) off it

# transformers' apply_chat_template parameters that are not template variables (a request's chat_template_kwargs
# holding them would change how it runs, not what the template sees)
_APPLY_CHAT_TEMPLATE_OWN = frozenset(
    {"chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict"}
    | {"return_assistant_tokens_mask", "tokenizer_kwargs", "conversation", "tools"}
)


class PromptRenderer:
    """A worker's tokenizer at work on prompts. A long text, or one the tokenizer cuts, is rendered off the
    event loop (1.8M tokens' text takes 3 s, which a worker's heartbeats cannot wait for), by one thread:
    a cut sets the tokenizer's truncation, so cuts use a copy of the tokenizer that only that thread
    touches, and the shared one is only ever read (by any thread: the engine's detokenizer too)."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prompts")
        self._cutting_tokenizer: Any = None  # made on the first cut, in the thread

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def check_token_ids(self, ids: Iterable[int], param: str, what: str | None = None) -> None:
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"{what or param + ' token ids'} must lie in [0, {vocab})", param=param)

    async def prompt_token_ids(self, req: PrefillRequest) -> list[int]:
        """A generation's prompt as token ids, its ids (and those of `logit_bias`, `stop_token_ids` and
        `allowed_token_ids`) checked; truncated as asked."""
        for param, ids in (
            ("logit_bias", map(int, req.sampling.logit_bias)),
            ("stop_token_ids", req.sampling.stop_token_ids),
            ("allowed_token_ids", req.sampling.allowed_token_ids or ()),
            ("logprob_token_ids", req.sampling.logprob_token_ids or ()),
        ):
            self.check_token_ids(ids, param)
        keep = kept_prompt_tokens(req.truncate_prompt_tokens, self.max_model_len, req.sampling.max_tokens)
        # (a text's truncation without a side given is the tokenizer's own, as vLLM's server encodes it)
        ids = await self.rendered(req, keep if req.truncation_side is None else None)
        return ids if keep is None else truncated(ids, keep, req.truncation_side or self.tokenizer.truncation_side)

    async def rendered(self, req: PrefillRequest | TokenizePrompt, max_length: int | None = None) -> list[int]:
        """A prompt in any of its forms as token ids, its text cut to `max_length` tokens by the tokenizer
        as it encodes it (None: whole)."""
        if max_length is None and _text_chars(req) <= INLINE_PROMPT_CHARS:
            return self._render(req, self.tokenizer)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._render_apart, req, max_length)

    async def read(self, of_ids: Callable[[list[int]], T], ids: list[int]) -> T:
        """`of_ids(ids)`, a reading of the shared tokenizer (its decode, its token strings), off the event
        loop for many ids."""
        if len(ids) <= INLINE_TOKEN_IDS:
            return of_ids(ids)
        return await asyncio.get_running_loop().run_in_executor(self._thread, of_ids, ids)

    def _render_apart(self, req: PrefillRequest | TokenizePrompt, max_length: int | None) -> list[int]:
        if max_length is None:
            return self._render(req, self.tokenizer)
        if self._cutting_tokenizer is None:
            self._cutting_tokenizer = copy.deepcopy(self.tokenizer)
        return self._render(req, self._cutting_tokenizer, truncation=True, max_length=max_length)

    async def shown_text(self, req: PrefillRequest, token_ids: list[int]) -> str | None:
        """The prompt's text where its answer shows it: a chat's rendered template with `prompt_text` (vLLM's
        return_prompt_text), else an echo's (`echoed_prompt`); None where neither is asked."""
        if req.sampling.prompt_text and req.messages is not None:
            if _text_chars(req) <= INLINE_PROMPT_CHARS:
                return self._template_text(req, self.tokenizer)
            return await asyncio.get_running_loop().run_in_executor(
                self._thread, self._template_text, req, self.tokenizer
            )
        return echoed_prompt(self.tokenizer, req, token_ids)

    def _template_text(self, req: PrefillRequest | TokenizePrompt, tok: Any) -> str:
        """A chat's prompt: its messages rendered by the model's chat template."""
        assert req.messages is not None
        if not req.messages:
            raise InvalidRequest("`messages` must not be empty", param="messages")
        variables = {"add_generation_prompt": True, **(req.template_kwargs or {})}
        try:
            text: str = tok.apply_chat_template(
                [_template_message(m) for m in req.messages],
                tools=req.tools,
                tokenize=False,
                **{k: v for k, v in variables.items() if k not in _APPLY_CHAT_TEMPLATE_OWN},
            )
        # (a template's raise_exception: roles out of order, say; transformers' own: a final message to
        # continue that is not the assistant's)
        except (jinja2.TemplateError, ValueError) as exc:
            raise InvalidRequest(f"the chat template refused the messages: {exc}", param="messages") from exc
        return text

    def _render(self, req: PrefillRequest | TokenizePrompt, tok: Any, **encode: Any) -> list[int]:
        if req.messages is not None:
            text = self._template_text(req, tok)
            return tok.encode(text, add_special_tokens=bool(req.add_special_tokens), **encode)
        if req.prompt_token_ids is not None:
            self.check_token_ids(req.prompt_token_ids, "prompt")
            return list(req.prompt_token_ids)
        if req.prompt is None:
            raise InvalidRequest("either `prompt` or `messages` is required", param="prompt")
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False, **encode)


def _text_chars(req: PrefillRequest | TokenizePrompt) -> int:
    """How much text a prompt has to render (its messages' or its own)."""
    return sum(len(m.content) for m in req.messages) if req.messages else len(req.prompt or "")


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: what is not set left undefined (a template tests what is), an
    assistant turn's reasoning as `reasoning` and `reasoning_content`, as vLLM's server gives it."""
    fields = message.model_dump(exclude_none=True)
    if message.reasoning is not None:
        fields["reasoning_content"] = message.reasoning
    return fields


def kept_prompt_tokens(truncate: int | None, max_model_len: int, max_tokens: int | None) -> int | None:
    """How many prompt tokens `truncate_prompt_tokens` keeps (None: all), as vLLM's server counts them
    (`TokenizeParams`): -1 is the context, less a token for the output where an output length is asked."""
    if truncate is None:
        return None
    if truncate > max_model_len:  # (vLLM's error)
        raise InvalidRequest(
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    return truncate if truncate >= 0 else max_model_len - 1 if max_tokens else max_model_len


def truncated(ids: list[int], keep: int, side: str) -> list[int]:
    """`ids` cut to `keep` from the `side` end ("left": the last ones kept), as vLLM's server cuts them."""
    if keep >= len(ids):
        return ids
    return ids[len(ids) - keep :] if side == "left" else ids[:keep]
