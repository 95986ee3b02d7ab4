"""The OpenAI objects of an answer: a whole answer's, a stream's chunks and events, usage and errors."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse

from llmesh.wire.errors import MeshError
from llmesh.wire.messages import LogprobSteps, TokenDelta


def error_body(exc: MeshError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}


def error_response(exc: MeshError) -> JSONResponse:
    """The OpenAI error for `exc`, with `Retry-After` (whole seconds) when the client should back off."""
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after is not None else None
    return JSONResponse(error_body(exc), status_code=exc.http_status, headers=headers)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `reasoning_tokens` where counted (a model with a reasoning parser: vLLM's server counts
    them then)."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


def echoed(delta: TokenDelta, prompt_alone: bool = False, with_text: bool = True) -> TokenDelta:
    """A choice's first delta with its prompt's text (and logprobs, if it has any) before its own, or
    instead of its own (`prompt_alone`: max_tokens 0), as vLLM's server echoes a prompt; without the prompt's
    text where `with_text` is false (vLLM's with return_token_ids, whose prompt ids stand for it)."""
    text, steps = ("", []) if prompt_alone else (delta.text, delta.logprobs or [])
    prompt_text = (delta.prompt_text or "") if with_text else ""
    update: dict[str, Any] = {"text": prompt_text + text}
    if delta.logprobs is not None:
        update["logprobs"] = [*(delta.prompt_logprobs or ()), *steps]
    return delta.model_copy(update=update)


def _clamped(logprob: float | None) -> float | None:
    """As vLLM's server gives a logprob: -inf as -9999.0 (JSON has no infinity); None (a prompt's first token's)."""
    return None if logprob is None else max(logprob, -9999.0)


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a whole (not streamed) answer."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    token_ids: list[int] | None = None
    logprobs: LogprobSteps | None = None
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None  # a chat's rendered prompt, where asked for
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # as vLLM shows them, where computed

    @classmethod
    def of(cls, deltas: list[TokenDelta]) -> Choice:
        """The choice that these deltas, all of its stream, make (its prompt's ids, text and logprobs on the
        first)."""
        first = deltas[0]
        return cls(
            "".join(d.text for d in deltas),
            deltas[-1].finish_reason,
            deltas[-1].completion_tokens,
            [t for d in deltas for t in d.token_ids],
            [step for d in deltas for step in d.logprobs or ()],
            deltas[-1].stop_reason,
            first.prompt_token_ids,
            first.prompt_text,
            shown_prompt_logprobs(first.prompt_logprobs, first.prompt_ranks),
        )


def shown_prompt_logprobs(
    steps: LogprobSteps | None, ranks: list[int | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """A prompt's logprobs as vLLM's server shows them (`prompt_logprobs`): None for its first token, then each
    token's step by token id: the prompt's own token first with its rank, then the likeliest, ranked from 1 on
    with the prompt's own token's rank left out (where it is among them, it is shown once, first)."""
    if steps is None or ranks is None:
        return None
    shown: list[dict[str, dict[str, Any]] | None] = [None]
    for (own, *likeliest), rank in zip(steps[1:], ranks[1:]):
        others = (r for r in itertools.count(1) if r != rank)
        shown.append(
            {
                str(token): {"logprob": _clamped(logprob), "rank": r, "decoded_token": text}
                for (token, logprob, text), r in [(own, rank), *zip(likeliest, others)]
            }
        )
    return shown


class ChoiceReading(Protocol):
    """How one streamed chat choice is read (`OutputReading.stream`)."""

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any]:
        """The chat delta's fields that this text makes (none while it reveals nothing yet)."""
        ...

    def finish_reason(self, reason: str | None) -> str | None: ...

    def reasoning_tokens(self) -> int | None:
        """Its reasoning tokens so far (None: not counted)."""
        ...


class OutputReading(Protocol):
    """How a chat's output is read, beyond text: calls forced as JSON (`tools.ToolCalling`), or what the model's
    parsers read (`parsed_output.ParsedOutput`)."""

    @property
    def hides_tokens(self) -> bool:
        """Whether its choices show no logprobs or token ids (they would show what it leaves out)."""
        ...

    def stream(self, prompt_token_ids: Sequence[int] | None) -> ChoiceReading: ...

    def answer(
        self, text: str, token_ids: Sequence[int], reason: str | None, prompt_token_ids: Sequence[int] | None
    ) -> tuple[dict[str, Any], str | None, int | None]:
        """A whole output's message, finish reason and reasoning tokens (None: not counted)."""
        ...


class ResponseShape:
    """Builds the OpenAI objects of one endpoint, so the handler code is shared by both."""

    _TEXT_MARK = "\x00"  # stands for a chunk's text in its template (JSON: "\u0000")

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        logprobs: int | None = None,
        reading: OutputReading | None = None,
        tokens_as_ids: bool = False,
        with_token_ids: bool = False,
        continuous_usage: bool = False,
        include_usage: bool = False,
        echo: str | None = None,
    ):
        """`logprobs`: how many of the likeliest tokens the request asked for with each token (None: no logprobs);
        `reading`: how a chat's output is read (None: as text); `tokens_as_ids`: logprobs' tokens as
        "token_id:<id>" (vLLM's return_tokens_as_token_ids); `with_token_ids`: each choice's token ids and
        its prompt's shown (vLLM's return_token_ids: a chat's prompt once, a completion's in each choice);
        `continuous_usage`: each chunk with its choice's usage so far (vLLM's continuous_usage_stats);
        `include_usage`: a stream ends with its usage; `echo`: the text a chat's answer begins with."""
        self.chat, self.id, self.model, self.reading = chat, request_id, model, reading
        hidden = reading is not None and reading.hides_tokens
        self.top = None if hidden else logprobs
        self.tokens_as_ids, self.with_token_ids = tokens_as_ids, with_token_ids and not hidden
        self.with_prompt_ids, self.continuous_usage = with_token_ids, continuous_usage
        self.include_usage, self.echo = include_usage, echo
        self.created = int(time.time())
        self._templates: dict[tuple[str | None, bool, int], tuple[bytes, bytes]] = {}
        self._text_offsets: dict[int, int] = {}  # a choice's next token's offset in its text, for completions' logprobs
        self._read: dict[int, ChoiceReading] = {}  # each streamed choice's reading so far

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _logprobs(self, steps: LogprobSteps | None, index: int) -> dict[str, Any] | None:
        """Choice `index`'s `logprobs` for these tokens, as vLLM's server renders them (each step's
        candidates start with the sampled token; -inf is -9999.0)."""
        if self.top is None:
            return None
        steps = steps or []
        if self.tokens_as_ids:
            steps = [[(t, lp, f"token_id:{t}") for t, lp, _ in step] for step in steps]
        if self.chat:

            def entry(text: str, logprob: float | None) -> dict[str, Any]:
                return {"token": text, "logprob": _clamped(logprob), "bytes": list(text.encode(errors="replace"))}

            return {
                "content": [
                    entry(step[0][2], step[0][1]) | {"top_logprobs": [entry(t, lp) for _, lp, t in step[: self.top]]}
                    for step in steps
                ]
            }
        tokens = [step[0][2] for step in steps]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self._text_offsets.get(index, 0)))
        self._text_offsets[index] = offsets.pop()
        return {
            "text_offset": offsets,
            "token_logprobs": [_clamped(step[0][1]) for step in steps],
            "tokens": tokens,
            "top_logprobs": [
                None if step[0][1] is None else {t: _clamped(lp) for _, lp, t in step[: self.top + 1]} for step in steps
            ],
        }

    def chunk(self, delta: TokenDelta, index: int = 0, first: bool = False) -> dict[str, Any]:
        """A streamed chunk of choice `index`, of `delta`; `first`: the choice's first (with its prompt's ids, which
        a parser may read and return_token_ids shows, and a chat's rendered prompt where asked for). With continuous
        usage, it shows the delta's counts: its prompt's tokens and the choice's so far."""
        text, finish_reason = delta.text, delta.finish_reason
        if self.chat and self.reading is not None:
            if first:
                self._read[index] = self.reading.stream(delta.prompt_token_ids)
            read = self._read[index]
            shown: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            shown |= read.delta(text, delta.token_ids, finish_reason is not None)
            if first and self.echo:
                shown["content"] = self.echo + (shown.get("content") or "")
            body: dict[str, Any] = {"delta": shown}
            finish_reason = read.finish_reason(finish_reason)
        elif self.chat:
            opened = (self.echo or "") + text if first else text
            body = {"delta": {"role": "assistant", "content": opened} if first else ({"content": text} if text else {})}
        else:
            body = {"text": text}
        prompt_ids = delta.prompt_token_ids if first and self.with_prompt_ids else None
        choice = self._choice(index, body, finish_reason, delta, prompt_ids)
        extra = _given(
            prompt_token_ids=prompt_ids if self.chat else None,
            prompt_text=delta.prompt_text if first and self.chat else None,
        )
        if self.continuous_usage:
            reading = self._read.get(index)
            reasoning = reading.reasoning_tokens() if reading is not None else None
            extra["usage"] = usage(delta.prompt_tokens, delta.completion_tokens, reasoning)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def _choice(
        self,
        index: int,
        body: dict[str, Any],
        finish_reason: str | None,
        of: TokenDelta | Choice,
        prompt_token_ids: list[int] | None,
    ) -> dict[str, Any]:
        """Choice `index` of a chunk (`of` a delta) or of a whole answer (`of` a choice), around its `body` (its
        text, as each shows it), with its prompt's ids where given and a completion's (a chat's are its
        envelope's)."""
        choice = {
            "index": index,
            **body,
            "finish_reason": finish_reason,
            "stop_reason": of.stop_reason,
            "logprobs": self._logprobs(of.logprobs, index),
        }
        if self.with_token_ids:
            choice["token_ids"] = of.token_ids
        if prompt_token_ids is not None and not self.chat:
            choice["prompt_token_ids"] = prompt_token_ids
        return choice

    def chunk_event(self, delta: TokenDelta, index: int = 0, first: bool = False) -> bytes:
        """`sse(self.chunk(...))`, rendered from a per-request template: a stream renders the same
        envelope for every token, and only the text changes (token ids, vLLM's `return_token_ids`
        extension, logprobs and a stop reason are rendered in full). Text that reveals nothing yet to the
        output's reading (a tool call's start, say) is no event (as vLLM's server sends none), unless the
        chunk carries more."""
        read = self.reading is not None and self.chat
        if (
            read
            or (self.chat and not delta.text and not first)  # (an empty chat delta)
            or self.with_prompt_ids
            or self.continuous_usage
            or self.top is not None
            or delta.stop_reason is not None
            or (first and (self.echo or (self.chat and delta.prompt_text is not None)))
        ):
            chunk = self.chunk(delta, index, first)
            choice = chunk["choices"][0]
            if read and not (choice["delta"] or choice["finish_reason"] or self.with_token_ids or self.top is not None):
                return b""
            return sse(chunk)
        key = (delta.finish_reason, first, index)
        template = self._templates.get(key)
        if template is None:
            marked = TokenDelta(text=self._TEXT_MARK, token_ids=[], finish_reason=delta.finish_reason)
            head, _, tail = sse(self.chunk(marked, index, first)).rpartition(json.dumps(self._TEXT_MARK).encode())
            template = self._templates[key] = head, tail
        return template[0] + json.dumps(delta.text).encode() + template[1]

    def _answer(self, choice: Choice) -> tuple[dict[str, Any], str | None, int | None]:
        """A chat choice's message (after the echo, if any), finish reason and reasoning tokens (None: not
        counted)."""
        if self.reading is None:
            message, finish_reason, reasoning_tokens = (
                {"role": "assistant", "content": choice.text},
                choice.finish_reason,
                None,
            )
        else:
            message, finish_reason, reasoning_tokens = self.reading.answer(
                choice.text, choice.token_ids or (), choice.finish_reason, choice.prompt_token_ids
            )
        if self.echo:
            message["content"] = self.echo + (message.get("content") or "")
        return message, finish_reason, reasoning_tokens

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """A stream's usage, its choices' reasoning tokens counted where the reading counts them."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        reasoning = _total(read.reasoning_tokens() for read in self._read.values())
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens, reasoning))

    def stream_end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """A stream's last events: its usage where asked for, and the end (`cached_tokens`: the prompt's found
        cached, which a chat's or completion's usage does not show, as vLLM's by default)."""
        counts = sse(self.usage_chunk(prompt_tokens, completion_tokens)) if self.include_usage else b""
        return counts + sse("[DONE]")

    def stream_error(self, exc: MeshError) -> bytes:
        """The event of an error that ends a stream (OpenAI's error object)."""
        return sse(error_body(exc))

    def final(self, choices: list[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The whole answer; its usage counts `prompt_tokens` (each prompt's once) and every choice's tokens,
        as vLLM does (`cached_tokens`: as `stream_end`'s)."""
        rendered, reasoning = [], []
        for index, c in enumerate(choices):
            if self.chat:
                message, finish_reason, reasoning_tokens = self._answer(c)
                body: dict[str, Any] = {"message": message}
                reasoning.append(reasoning_tokens)
            else:
                body, finish_reason = {"text": c.text}, c.finish_reason
            choice = self._choice(index, body, finish_reason, c, c.prompt_token_ids if self.with_prompt_ids else None)
            if c.prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = c.prompt_logprobs
            rendered.append(choice)
        completion_tokens = sum(c.completion_tokens for c in choices)
        answer_usage = usage(prompt_tokens, completion_tokens, _total(reasoning))
        if not self.chat:
            return self._envelope("text_completion", rendered, usage=answer_usage)
        prompt_ids = choices[0].prompt_token_ids if self.with_prompt_ids else None  # (a chat's one prompt)
        shown = _given(
            prompt_token_ids=prompt_ids, prompt_text=choices[0].prompt_text, prompt_logprobs=choices[0].prompt_logprobs
        )
        return self._envelope("chat.completion", rendered, usage=answer_usage, **shown)


def _given(**fields: Any) -> dict[str, Any]:
    """The fields that are not None."""
    return {k: v for k, v in fields.items() if v is not None}


def _total(counts: Iterable[int | None]) -> int | None:
    """The sum of counts, None where none was counted."""
    counted = [c for c in counts if c is not None]
    return sum(counted) if counted else None
