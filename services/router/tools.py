"""Tool calling, as vLLM's server does it for a forced call (`tool_choice` "required" or a named function):
the output constrained to JSON by the tools' schemas, then read back as OpenAI's `tool_calls`, whole or
streamed, for models without a parser of their own call format (`parsed_output`), which refuse "auto".

The constraint, the reading of a whole output and the streamed deltas follow vLLM 0.32
(`vllm/tool_parsers/utils.py`, `vllm/parser/abstract_parser.py`, `vllm/tool_parsers/streaming.py`, Apache-2.0);
`tests/unit/test_tools.py` checks them against vLLM's own functions.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from llmesh.wire.errors import InvalidRequest

# vLLM's error for "auto" without a parser, reworded for the mesh (its setting named)
AUTO_REFUSED = (
    'tool_choice "auto" (the default with tools) needs a parser of the model\'s own tool-call format: the mesh '
    "has none for this model (its `tool_call_parser` in MESH_MODELS, vLLM's --tool-call-parser); "
    'use "required" or a named function (or "none")'
)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    """A function the model may call; dumped for the chat template as vLLM's server dumps it."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: _NamedFunction


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as a client sends it back."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction

    def for_template(self) -> dict[str, Any]:
        """With its arguments as an object, as chat templates take them (vLLM's rule: arguments that are not
        a JSON object count as none, so a bad turn in a history does not fail every later request)."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except json.JSONDecodeError:
                arguments = {}
        call = {
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments if isinstance(arguments, dict) else {}},
        }
        return call if self.id is None else {"id": self.id, **call}


_CALLS = TypeAdapter(list[FunctionDefinition])  # how vLLM reads a "required" output back


def _params(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}  # (a function without any: an empty object)


@dataclass(frozen=True)
class ToolCalling:
    """A request's forced tool call: `function` names the one to call, or None for "required" (any of
    them, one or more unless `parallel` is False)."""

    tools: tuple[Tool, ...]
    function: str | None = None
    parallel: bool = True
    hides_tokens: ClassVar[bool] = False  # (an output's reading hides no logprobs or token ids)

    def constraint(self) -> dict[str, Any]:
        """The structured output (vLLM's StructuredOutputsParams fields) that makes the output a call."""
        if self.function is not None:
            function = next(t.function for t in self.tools if t.function.name == self.function)
            return {"json": _params(function.parameters)}
        defs: dict[str, Any] = {}  # each tool's $defs, hoisted to the array's (where its $refs point)
        for tool in self.tools:
            for name, definition in ((tool.function.parameters or {}).get("$defs") or {}).items():
                if defs.setdefault(name, definition) != definition:
                    raise InvalidRequest(
                        f"Tool definition '{name}' has multiple schemas, which is not supported.", param="tools"
                    )
        calls = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": {k: v for k, v in _params(t.function.parameters).items() if k != "$defs"},
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return {"json": schema}

    def calls(self, text: str) -> list[dict[str, Any]]:
        """A whole output's calls, as OpenAI's `tool_calls` (none where a "required" output does not parse:
        cut by max_tokens, say)."""
        if self.function is not None:
            return [_call(self.function, text)] if text.strip() else []
        try:
            read = _CALLS.validate_json(text)
        except ValidationError:
            return []
        calls = [_call(c.name, json.dumps(c.parameters, ensure_ascii=False)) for c in read]
        return calls if self.parallel else calls[:1]

    def finish_reason(self, reason: str | None, called: bool = True) -> str | None:
        """OpenAI's: "tool_calls" where a "required" output ended by itself (a named call's stays "stop")."""
        return "tool_calls" if reason == "stop" and self.function is None and called else reason

    def answer(
        self, text: str, token_ids: Sequence[int], reason: str | None, prompt_token_ids: Sequence[int] | None = None
    ) -> tuple[dict[str, Any], str | None, int | None]:
        """A whole output's message, finish reason and reasoning tokens (none counted)."""
        return {"role": "assistant", "content": "", "tool_calls": self.calls(text)}, self.finish_reason(reason), None

    def stream(self, prompt_token_ids: Sequence[int] | None = None) -> ToolCallStream:
        return ToolCallStream(self)


def _call(name: str, arguments: str) -> dict[str, Any]:
    call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"  # (vLLM's form)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolCallStream:
    """One choice's streamed calls: each delta of text becomes `tool_calls` deltas, a call's first with its
    id, type and name, the later ones with its arguments' new text."""

    calling: ToolCalling
    text: str = ""
    announced: bool = False  # a call has been sent

    def delta(self, text: str, token_ids: Sequence[int] = (), finished: bool = False) -> dict[str, Any]:
        """The chat delta's fields (its tool_calls) this text makes; none while no call can be told yet."""
        calls = self._calls(text)
        return {"tool_calls": calls} if calls else {}

    def _calls(self, text: str) -> list[dict[str, Any]]:
        previous, self.text = self.text, self.text + text
        if self.calling.function is not None:
            if self.announced:
                return [{"index": 0, "function": {"arguments": text}}] if text else []
            self.announced = True
            return [{"index": 0, **_call(self.calling.function, text)}]
        deltas = _required_deltas(previous, self.text)
        self.announced = self.announced or bool(deltas)
        if deltas and not self.calling.parallel:
            deltas = [d for d in deltas if d["index"] == 0]
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return self.calling.finish_reason(reason, self.announced)

    def reasoning_tokens(self) -> int | None:
        return None


@dataclass
class _CallSpan:
    """Where one element of a "required" array lies in the text: its name once its string is closed (and
    where that ends), and the span of its parameters' value (no end while it is being generated). The
    offsets of any prefix of the text are those of the whole, cut to it."""

    name: str | None = None
    name_end: int | None = None
    args_start: int | None = None
    args_end: int | None = None

    def ready_at(self, length: int) -> bool:
        """Whether the text's first `length` characters had made this call streamable."""
        return (
            self.name is not None
            and self.name_end is not None
            and self.name_end <= length
            and self.args_start is not None
            and self.args_start < length
        )

    @property
    def ready(self) -> bool:
        return self.name is not None and self.args_start is not None


_EXPECT_KEY, _EXPECT_COLON, _EXPECT_VALUE, _IN_STRING, _IN_CONTAINER, _IN_SCALAR, _AFTER_VALUE = range(7)


def _scan_calls(text: str) -> list[_CallSpan]:
    """Every call of a (maybe partial) "required" array, in one pass aware of strings and nesting; what
    follows the array's `]` is ignored. Only the elements' own keys are read, so nothing inside a value
    can confuse it."""
    spans: list[_CallSpan] = []
    depth = 0  # of {} and []: the elements' keys lie at 2
    in_string = escaped = False
    string_start = value_start = 0
    cur: _CallSpan | None = None
    expect, key = _EXPECT_KEY, None

    def end_value(pos: int) -> None:
        nonlocal expect
        assert cur is not None
        if key == "parameters":
            cur.args_end = pos
        elif key == "name" and expect == _IN_STRING:
            try:
                cur.name, cur.name_end = json.loads(text[value_start:pos]), pos
            except json.JSONDecodeError:
                cur.name = None  # never ready, as the whole output's reading refuses it
        expect = _AFTER_VALUE

    def start_value(pos: int, state: int) -> None:
        nonlocal expect, value_start
        assert cur is not None
        value_start = pos
        if key == "parameters":
            cur.args_start = pos
        expect = state

    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and cur is not None:
                    if expect == _EXPECT_KEY:
                        key, expect = text[string_start + 1 : i], _EXPECT_COLON
                    elif expect == _IN_STRING:
                        end_value(i + 1)
            continue
        if ch == '"':
            in_string, string_start = True, i
            if depth == 2 and cur is not None and expect == _EXPECT_VALUE:
                start_value(i, _IN_STRING)
        elif ch in "{[":
            if depth == 0 and ch != "[" or depth == 1 and ch != "{":
                return spans
            if depth == 1:
                cur = _CallSpan()
                spans.append(cur)
                expect, key = _EXPECT_KEY, None
            elif depth == 2 and cur is not None and expect == _EXPECT_VALUE:
                start_value(i, _IN_CONTAINER)
            depth += 1
        elif ch in "}]":
            if depth == 2 and cur is not None and expect == _IN_SCALAR:
                end_value(i)
            depth -= 1
            if depth == 2 and cur is not None and expect == _IN_CONTAINER:
                end_value(i + 1)
            elif depth == 1:
                cur = None
            elif depth <= 0:
                return spans
        elif depth != 2 or cur is None:
            continue
        elif ch == ":":
            if expect == _EXPECT_COLON:
                expect = _EXPECT_VALUE
        elif ch == ",":
            if expect == _IN_SCALAR:
                end_value(i)
            expect, key = _EXPECT_KEY, None
        elif ch.isspace():
            if expect == _IN_SCALAR:
                end_value(i)
        elif expect == _EXPECT_VALUE:
            start_value(i, _IN_SCALAR)
    return spans


def _required_deltas(previous: str, current: str) -> list[dict[str, Any]]:
    """What the text past `previous` reveals of a "required" array's calls: each call's first delta (id,
    name, arguments so far), then its arguments' new text."""
    deltas: list[dict[str, Any]] = []
    for index, span in enumerate(_scan_calls(current)):
        if not span.ready:
            break  # (calls come in order: none after it is ready)
        assert span.args_start is not None and span.name is not None
        end = span.args_end if span.args_end is not None else len(current)
        if span.ready_at(len(previous)):
            if new := current[min(end, len(previous)) : end]:
                deltas.append({"index": index, "function": {"arguments": new}})
        else:
            deltas.append({"index": index, **_call(span.name, current[span.args_start : end])})
    return deltas


def tool_calling(
    tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool | None
) -> ToolCalling | None:
    """A request's forced call (None where the output is text, or "auto": `parsed_output`), with vLLM's errors."""
    if tools is not None and not tools:
        raise InvalidRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if tools is None:
        raise InvalidRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        return None
    if choice == "required":
        return ToolCalling(tuple(tools), None, parallel is not False)
    assert isinstance(choice, NamedToolChoice)  # (the field's type)
    if not any(t.function.name == choice.function.name for t in tools):
        raise InvalidRequest(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", param="tool_choice"
        )
    return ToolCalling(tuple(tools), choice.function.name, parallel is not False)
