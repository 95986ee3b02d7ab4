"""OpenAI's Responses API (`/v1/responses`) over the chat path: a request becomes a chat completion's (its input
items and any earlier response's conversation as messages), and the chat's objects become a response's output
items and stream events, as vLLM 0.32's server renders them for a model without Harmony
(`vllm/entrypoints/openai/responses/`, Apache-2.0), but for a stream cut by max_output_tokens, which ends with
OpenAI's `response.incomplete` (vLLM's: `response.completed`). Stored responses live in Redis (`ResponseStore`),
so any router continues a conversation (`previous_response_id`) that another one answered.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
import redis.exceptions
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from llmesh.wire.errors import InvalidRequest, MeshError, ResponseNotFound, ServiceUnavailable
from llmesh.wire.messages import TokenDelta

from .schemas import (
    _FORM,
    MAX_LOGPROBS,
    MAX_TOOLS,
    UNSUPPORTED,
    ChatCompletionRequest,
    PositiveInt64,
    _Body,
    validation_error,
)
from .shapes import Choice, OutputReading, ResponseShape

log = logging.getLogger(__name__)

# Chat completion fields a response request passes on as they are (vLLM's ResponsesRequest has them, and the mesh's
# targets); the chat's validation reads them, and refuses the unsupported ones it lists.
PASSED_ON = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "chat_template_kwargs",
    "include_reasoning",
    "thinking_token_budget",
    "priority",
    "cache_salt",
    "ttft_slo_ms",
    "tpot_slo_ms",
    *UNSUPPORTED,
)
# a chat field's name as a response request calls it, in errors
_RESPONSE_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
_INCLUDES = {
    "message.output_text.logprobs",  # done
    # vLLM's, each about a built-in tool or encrypted reasoning the mesh has not: accepted, nothing to include
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "reasoning.encrypted_content",
}
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, a key's and a value's characters
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


class _Text(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


def _text_only(content: Any) -> Any:
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text", "text"):
            raise ValueError(f"only text content parts are supported, not {str(part.get('type'))[:40]!r}")
    return content


def _joined(content: str | list[_Text]) -> str:
    """Text parts joined by newlines, as the chat path joins a message's parts."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class _InputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None  # (as a client sends an earlier output back)


class _Message(_InputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Text]

    _text_parts = field_validator("content", mode="before")(lambda cls, content: _text_only(content))


class _FunctionCall(_InputItem):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(_InputItem):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Text]

    _text_parts = field_validator("output", mode="before")(lambda cls, output: _text_only(output))


class _Reasoning(_InputItem):
    type: Literal["reasoning"]
    content: list[_Text] | None = None
    summary: list[_Text] = []
    encrypted_content: None = Field(default=None, description="(refused: the mesh encrypts no reasoning)")

    def text(self) -> str:
        """vLLM's: its content's first part, else its summary's."""
        parts = self.content or self.summary
        return parts[0].text if parts else ""


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_ITEMS = tuple(_ID_PREFIXES)


def _item_type(item: Any) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


_Item = Annotated[
    Annotated[_Message, Tag(f"{_FORM}message")]
    | Annotated[_FunctionCall, Tag(f"{_FORM}function_call")]
    | Annotated[_FunctionCallOutput, Tag(f"{_FORM}function_call_output")]
    | Annotated[_Reasoning, Tag(f"{_FORM}reasoning")],
    Discriminator(lambda item: f"{_FORM}{_item_type(item)}"),
]
# a text or items (told apart, so that an error names the items' field, not the text's)
_Input = Annotated[
    Annotated[str, Tag(f"{_FORM}text")] | Annotated[list[_Item], Tag(f"{_FORM}items")],
    Discriminator(lambda value: f"{_FORM}text" if isinstance(value, str) else f"{_FORM}items"),
]


_ITEM_LIST: TypeAdapter[list[_Item]] = TypeAdapter(list[_Item])


def as_messages(items: list[_Item]) -> list[dict[str, Any]]:
    """Input or output items as chat messages, merged as vLLM merges them: an assistant's reasoning, text and calls,
    given as items in a row, are one assistant message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if isinstance(item, _FunctionCall):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, _Reasoning):
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = item.text()
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": item.text()})
        elif isinstance(item, _FunctionCallOutput):
            messages.append({"role": "tool", "content": _joined(item.output), "tool_call_id": item.call_id})
        elif item.role == "assistant" and last is not None and last.get("content") is None:
            last["content"] = _joined(item.content)
        else:
            messages.append({"role": item.role, "content": _joined(item.content)})
    return messages


class _FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class _Format(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> _Format:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise InvalidRequest("a json_schema format needs its `name` and `schema`", param="text.format")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat's `response_format` of this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.json_schema, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class _TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: _Format | None = None


class _ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: the mesh writes no summaries


class ResponsesRequest(_Body):
    """OpenAI's response request, the subset the mesh does (the rest refused, never ignored where it would change
    what is generated), and vLLM's sampling extensions (`PASSED_ON`)."""

    model_config = ConfigDict(extra="allow")  # (PASSED_ON's read from the extras; the rest ignored)
    model: str
    input: _Input
    instructions: str | None = None
    max_output_tokens: PositiveInt64 | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    tools: list[_FunctionTool] = Field(default=[], max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | _NamedFunction = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(default=None, ge=1)  # (built-in tools': echoed)
    text: _TextConfig | None = None
    reasoning: _ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # "auto" would drop the conversation's first items where it overflows the context: here it is a 400 either way
    truncation: Literal["auto", "disabled"] = "disabled"
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    background: Literal[False] = False
    prompt: None = None
    conversation: None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """Clear words for what the mesh does not do (the schema would say only that the value is wrong)."""
        if isinstance(data, dict):
            if data.get("background"):
                raise InvalidRequest("background responses are not supported", param="background")
            for name, what in (("prompt", "reusable prompts"), ("conversation", "conversations")):
                if data.get(name) is not None:
                    raise InvalidRequest(f"{what} are not supported: send the input", param=name)
            for index, tool in enumerate(data.get("tools") or ()):
                if isinstance(tool, dict) and tool.get("type") != "function":
                    kind = str(tool.get("type"))[:40]
                    raise InvalidRequest(f"only function tools are supported, not {kind!r}", param=f"tools.{index}")
            items = data.get("input")
            for index, item in enumerate(items if isinstance(items, list) else []):
                if (item_kind := _item_type(item)) not in _ITEMS:
                    raise InvalidRequest(
                        f"input items of type {str(item_kind)[:40]!r} are not supported (only {', '.join(_ITEMS)})",
                        param=f"input.{index}",
                    )
                if item_kind == "reasoning" and item.get("encrypted_content"):
                    raise InvalidRequest("encrypted reasoning is not supported", param=f"input.{index}")
        return data

    @field_validator("include")
    @classmethod
    def _includes(cls, include: list[str] | None) -> list[str] | None:
        if unknown := set(include or ()) - _INCLUDES:
            raise ValueError(f"unknown values {sorted(unknown)} (known: {', '.join(sorted(_INCLUDES))})")
        return include

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and (
            len(metadata) > MAX_METADATA
            or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items())
        ):
            raise ValueError(
                f"at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} characters "
                f"and values of at most {MAX_METADATA_VALUE}"
            )
        return metadata

    def input_items(self) -> list[dict[str, Any]]:
        """The input as OpenAI lists a response's input items: each with an id (its own, where it came with one),
        a message's text as a part."""
        items = [_Message(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        listed = []
        for item in items:
            fields = item.model_dump(exclude_none=True)
            if isinstance(item, _Message):
                kind = "output_text" if item.role == "assistant" else "input_text"
                fields["status"] = "completed"
                if isinstance(item.content, str):
                    fields["content"] = [{"type": kind, "text": item.content}]
            listed.append({**fields, "id": item.id or _new_id(_ID_PREFIXES[item.type])})
        return listed

    @property
    def with_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    def input_messages(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return as_messages(self.input)

    def chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion that generates this response, after `history` (an earlier response's conversation,
        whose instructions do not carry over, as OpenAI's do not)."""
        instructions = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [*instructions, *history, *self.input_messages()],
            "stream": self.stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(include={"name", "description", "parameters"})}
                for t in self.tools
            ]
            choice = self.tool_choice
            body["tool_choice"] = (
                choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
            )
        elif self.tool_choice not in ("auto", "none"):
            raise InvalidRequest("`tool_choice` needs `tools`", param="tool_choice")
        if self.with_logprobs:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        body |= {name: value for name, value in (self.model_extra or {}).items() if name in PASSED_ON}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:
            errors: list[dict[str, Any]] = [dict(e) for e in exc.errors()]
            for error in errors[:1]:  # (the one an error names)
                loc = [str(p) for p in error["loc"]]
                error["loc"] = [_RESPONSE_NAMES.get(loc[0], loc[0]), *loc[1:]] if loc else loc
            raise validation_error(errors) from None
        except InvalidRequest as exc:
            exc.param = _RESPONSE_NAMES.get(exc.param or "", exc.param)
            raise

    def echoed(self) -> dict[str, Any]:
        """What a response repeats of its request."""
        tool_choice = self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": self.reasoning.model_dump() if self.reasoning is not None else None,
            "service_tier": self.service_tier,
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}
            if self.text is not None and self.text.format is not None
            else {"format": {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [t.model_dump() for t in self.tools],
            "top_logprobs": self.top_logprobs,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": self.truncation,
            "user": self.user,
        }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Open:
    """The output item a stream is writing."""

    kind: Literal["message", "reasoning", "function_call"]
    id: str
    text: str = ""  # its text, reasoning or arguments so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    name: str = ""  # a call's
    call_id: str = ""
    index: int | None = None  # a call's index among the chat's calls


class ResponsesShape(ResponseShape):
    """A response's objects and events, read from the chat's that the base class builds (one choice)."""

    def __init__(self, request: ResponsesRequest, response_id: str, reading: OutputReading | None):
        super().__init__(
            True, response_id, request.model, request.top_logprobs if request.with_logprobs else None, reading
        )
        self.request = request
        self.sequence = 0  # the next event's
        self.items: list[dict[str, Any]] = []  # the output items written
        self.writing: _Open | None = None
        self.finish_reason: str | None = None
        self.response: dict[str, Any] | None = None  # the whole response, once it has ended

    def resource(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object, as OpenAI's (`incomplete`: cut by max_output_tokens, its only cause here)."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            "usage": usage,
            **self.request.echoed(),
        }

    def final(self, choices: list[Choice], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        chat = super().final(choices, prompt_tokens)
        (choice,) = chat["choices"]
        message, written = choice["message"], []
        if message.get("reasoning"):
            written.append(_Open("reasoning", _new_id("rs"), message["reasoning"]))
        if message.get("content"):
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            written.append(_Open("message", _new_id("msg"), message["content"], logprobs))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            written.append(
                _Open("function_call", _new_id("fc"), function["arguments"], [], function["name"], call["id"])
            )
        status = _status(choice["finish_reason"])
        output = [_item(item, status if i == len(written) - 1 else "completed") for i, item in enumerate(written)]
        self.response = self.resource(status, output, _usage(chat["usage"], cached_tokens))
        return self.response

    def chunk_event(self, delta: TokenDelta, index: int = 0, first: bool = False) -> bytes:
        """The events of a chat chunk; the first opens the response."""
        chunk = self.chunk(delta, index, first)
        events: list[bytes] = []
        if self.sequence == 0:
            started = self.resource("in_progress", [], None)
            events += [
                self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
            ]
        (choice,) = chunk["choices"]
        shown = choice["delta"]
        if shown.get("reasoning"):
            events += self._write("reasoning", shown["reasoning"])
        if shown.get("content"):
            events += self._write("message", shown["content"], (choice.get("logprobs") or {}).get("content") or [])
        for call in shown.get("tool_calls") or ():
            function = call.get("function") or {}
            if self.writing is None or self.writing.kind != "function_call" or self.writing.index != call["index"]:
                events += self._start(
                    _Open(
                        "function_call",
                        _new_id("fc"),
                        name=function.get("name") or "",
                        index=call["index"],
                        call_id=call.get("id") or _new_id("call"),
                    )
                )
            if arguments := function.get("arguments"):
                events += self._write("function_call", arguments)
        self.finish_reason = choice["finish_reason"] or self.finish_reason
        return b"".join(events)

    def stream_end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The last item's end and the response's (`response.completed`, or `response.incomplete`: cut short, as
        its last item is)."""
        status = _status(self.finish_reason)
        events = self._finish(status)
        chat_usage = self.usage_chunk(prompt_tokens, completion_tokens)["usage"]
        self.response = self.resource(status, self.items, _usage(chat_usage, cached_tokens))
        events.append(self._event(f"response.{status}", response=self.response))
        return b"".join(events)

    def stream_error(self, exc: MeshError) -> bytes:
        """`response.failed`, with the error (the stream ends after it)."""
        failed = self.resource("failed", self.items, None) | {"error": {"code": exc.code, "message": exc.message}}
        return self._event("response.failed", response=failed)

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()

    def _write(
        self, kind: Literal["message", "reasoning", "function_call"], text: str, logprobs: Sequence[Any] = ()
    ) -> list[bytes]:
        events = (
            []
            if self.writing is not None and self.writing.kind == kind
            else self._start(_Open(kind, _new_id("msg" if kind == "message" else "rs")))
        )
        writing = self.writing
        assert writing is not None
        writing.text += text
        where = {"item_id": writing.id, "output_index": len(self.items)}
        if kind == "function_call":
            return [*events, self._event("response.function_call_arguments.delta", **where, delta=text)]
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        writing.logprobs += logprobs
        streamed = [
            {
                "token": lp["token"],
                "logprob": lp["logprob"],
                "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]],
            }
            for lp in logprobs
        ]
        return [
            *events,
            self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=streamed),
        ]

    def _start(self, item: _Open) -> list[bytes]:
        events = self._finish()
        self.writing = item
        where = {"output_index": len(self.items)}
        events.append(self._event("response.output_item.added", **where, item=_item(item, "in_progress")))
        if item.kind != "function_call":
            part = _part(_Open(item.kind, item.id))
            events.append(
                self._event("response.content_part.added", item_id=item.id, **where, content_index=0, part=part)
            )
        return events

    def _finish(self, status: str = "completed") -> list[bytes]:
        """The written item's end events, `status` its; it joins the output."""
        item, self.writing = self.writing, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": len(self.items)}
        done = _item(item, status)
        if item.kind == "function_call":
            events = [
                self._event("response.function_call_arguments.done", **where, name=item.name, arguments=item.text)
            ]
        else:
            part = _part(item)
            kind = "output_text" if item.kind == "message" else "reasoning_text"
            events = [
                self._event(f"response.{kind}.done", **where, content_index=0, text=item.text)
                if item.kind == "reasoning"
                else self._event(
                    f"response.{kind}.done", **where, content_index=0, text=item.text, logprobs=item.logprobs
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=done))
        self.items.append(done)
        return events


def _part(item: _Open) -> dict[str, Any]:
    """A message's or reasoning's content, as far as it is written."""
    if item.kind == "reasoning":
        return {"type": "reasoning_text", "text": item.text}
    return {"type": "output_text", "text": item.text, "annotations": [], "logprobs": item.logprobs}


def _item(item: _Open, status: str) -> dict[str, Any]:
    """The output item, `status` its ("in_progress": as it starts, empty)."""
    if item.kind == "function_call":
        arguments = item.text if status != "in_progress" else ""
        return {
            "id": item.id,
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": arguments,
            "status": status,
        }
    content = [_part(item)] if status != "in_progress" else []
    if item.kind == "reasoning":
        return {"id": item.id, "type": "reasoning", "summary": [], "content": content, "status": status}
    return {"id": item.id, "type": "message", "role": "assistant", "status": status, "content": content}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(chat: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    """A chat's usage as a response's."""
    reasoning = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": chat["total_tokens"],
    }


def conversation(
    history: list[dict[str, Any]], request: ResponsesRequest, response: dict[str, Any]
) -> list[dict[str, Any]]:
    """The conversation a response ends, as chat messages (its instructions left out): where a response that
    continues it starts."""
    return [*history, *request.input_messages(), *as_messages(_ITEM_LIST.validate_python(response["output"]))]


class ResponseStore:
    """Responses kept in Redis for `ttl_s` (each with its API key's name and its conversation), so that a request
    on any router continues one (`previous_response_id`), and a client reads or deletes it; none without Redis
    (`store` is then ignored, as vLLM's server ignores it by default). Another key's response is not found."""

    def __init__(self, redis_url: str, ttl_s: float, timeout_s: float = 2.0):
        self.ttl_s = ttl_s
        self.redis = (
            aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            if redis_url
            else None
        )

    @staticmethod
    def _key(response_id: str) -> str:
        return f"llmesh:response:{response_id}"

    async def keep(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        input_items: list[dict[str, Any]],
        owner: str,
    ) -> None:
        """Stores it; where Redis fails, the answer still goes out (logged: it cannot be continued)."""
        if self.redis is None:
            return
        record = {"owner": owner, "response": response, "conversation": conversation, "input_items": input_items}
        text = json.dumps(record)
        try:
            await self.redis.set(self._key(response["id"]), text, px=int(self.ttl_s * 1000))
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("response %s not stored (it cannot be continued or read back): %s", response["id"], exc)

    @property
    def enabled(self) -> bool:
        return self.redis is not None

    async def record(self, response_id: str, owner: str, param: str = "response_id") -> dict[str, Any]:
        """Its stored record ("response", "conversation", "input_items"); ResponseNotFound (naming `param`) where
        none is, for this owner."""
        if self.redis is None:
            raise ResponseNotFound(
                f"no response {response_id!r}: this mesh stores none (its router has no MESH_REDIS_URL)", param=param
            )
        try:
            raw = await self.redis.get(self._key(response_id))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise ServiceUnavailable(f"the stored responses cannot be read now: {exc}") from exc
        record = json.loads(raw) if raw is not None else None
        if record is None or record["owner"] != owner:
            raise ResponseNotFound(f"no response {response_id!r} (expired, deleted or never stored)", param=param)
        return record

    async def delete(self, response_id: str, owner: str) -> None:
        await self.record(response_id, owner)
        try:
            await self.redis.delete(self._key(response_id))  # type: ignore[union-attr]  # (record: there is one)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise ServiceUnavailable(f"the stored responses cannot be changed now: {exc}") from exc

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


def page(items: list[dict[str, Any]], after: str | None, limit: int, order: Literal["asc", "desc"]) -> dict[str, Any]:
    """OpenAI's list of `items` (their own order "asc"), `limit` of them from the one after `after`."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequest(f"no item {after!r} in this response's input", param="after")
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }
