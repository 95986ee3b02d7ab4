"""OpenAI request schemas (the supported subset, validated) and response/chunk builders."""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmesh.wire.errors import InvalidRequest, MeshError
from llmesh.wire.messages import ChatMessage, SamplingOptions

# What the bus carries (MessagePack's integers): larger numbers are a 400 here, not a failure to encode.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
PositiveInt64 = Annotated[int, Field(ge=1, le=2**63 - 1)]


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are accepted and ignored

    model: str
    max_tokens: PositiveInt64 | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM extension: completion token ids in each choice
    cache_salt: str | None = None  # vLLM extension: prefix-cache isolation between tenants
    ignore_eos: bool = False  # vLLM extension: generate max_tokens even past EOS (benchmarks use it)
    priority: Int64 = 0  # vLLM extension: lower is more urgent (read by the dispatch policy)
    ttft_slo_ms: float | None = Field(default=None, gt=0)  # mesh extension: this request's time-to-first-token target
    tpot_slo_ms: float | None = Field(default=None, gt=0)  # mesh extension: its time-per-output-token target

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may escape lone surrogates ("\\ud800"), which no UTF-8 text (nor any engine) can hold."""

        def check(value: Any) -> None:
            if isinstance(value, str):
                try:
                    value.encode()
                except UnicodeEncodeError:
                    raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
            elif isinstance(value, dict):
                for item in value.values():
                    check(item)
            elif isinstance(value, list):
                for item in value:
                    check(item)

        check(data)
        return data

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, salt: str | None) -> str | None:
        """vLLM's rules, so a client moving between vLLM and the mesh sees the same errors."""
        if salt is not None and (not salt or len(salt) > 128 or any(c in "@/\\\0" for c in salt)):
            raise ValueError("cache_salt must be 1 to 128 characters and must not contain '@', '/', '\\' or NUL")
        return salt

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop cannot contain an empty string")  # vLLM's rule (its engine raised it: a 500)
        return stop

    def sampling(self) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingOptions(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int64]
    max_tokens: PositiveInt64 | None = 16
    echo: bool = False
    logprobs: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        if self.echo or self.logprobs:
            raise ValueError("echo and logprobs are not supported")
        return self

    @property
    def prompt_text(self) -> str | None:
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[0] if self.prompt and isinstance(self.prompt[0], str) else None

    @property
    def prompt_token_ids(self) -> list[int] | None:
        if isinstance(self.prompt, list) and all(isinstance(t, int) for t in self.prompt):
            return list(self.prompt)  # type: ignore[arg-type]
        return None


class _ChatPart(BaseModel):
    type: Literal["text"]
    text: str


class _ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[_ChatPart]

    def to_message(self) -> ChatMessage:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=content)


class ChatCompletionRequest(_Common):
    messages: list[_ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: PositiveInt64 | None = None
    logprobs: bool = False

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


def error_body(exc: MeshError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}


def error_response(exc: MeshError) -> JSONResponse:
    """The OpenAI error for `exc`, with `Retry-After` (whole seconds) when the client should back off."""
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after is not None else None
    return JSONResponse(error_body(exc), status_code=exc.http_status, headers=headers)


def validation_error(errors: list[dict[str, Any]]) -> InvalidRequest:
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return InvalidRequest(f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}")
    return InvalidRequest(f"{'.'.join(loc) or 'body'}: {msg}", param=".".join(loc) or None)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the OpenAI objects of one endpoint, so the handler code is shared by both."""

    _TEXT_MARK = "\x00"  # stands for a chunk's text in its template (JSON: "\u0000")

    def __init__(self, chat: bool, request_id: str, model: str):
        self.chat, self.id, self.model = chat, request_id, model
        self.created = int(time.time())
        self._templates: dict[tuple[str | None, bool], tuple[bytes, bytes]] = {}

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def chunk(
        self, text: str, finish_reason: str | None, first: bool = False, token_ids: list[int] | None = None
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def chunk_event(
        self, text: str, finish_reason: str | None, first: bool = False, token_ids: list[int] | None = None
    ) -> bytes:
        """`sse(self.chunk(...))`, rendered from a per-request template: a stream renders the same
        envelope for every token, and only the text changes (`token_ids`, vLLM's `return_token_ids`
        extension, are rendered in full)."""
        if (self.chat and not text and not first) or token_ids is not None:  # an empty chat delta has no content key
            return sse(self.chunk(text, finish_reason, first, token_ids))
        key = (finish_reason, first)
        template = self._templates.get(key)
        if template is None:
            head, _, tail = sse(self.chunk(self._TEXT_MARK, finish_reason, first)).rpartition(
                json.dumps(self._TEXT_MARK).encode()
            )
            template = self._templates[key] = head, tail
        return template[0] + json.dumps(text).encode() + template[1]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens))

    def final(
        self,
        text: str,
        finish_reason: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"finish_reason": finish_reason, "logprobs": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, [choice], usage=usage(prompt_tokens, completion_tokens))
