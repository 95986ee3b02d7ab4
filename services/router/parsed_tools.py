"""Tool calls read by vLLM's parser of a model's own call format: a catalogue model's `tool_call_parser`
(vLLM's `--tool-call-parser` with `--enable-auto-tool-choice`). It runs here, in the router, which sees each
choice's whole output whichever engines generated it. Where a model has one, every chat that may call its
tools (`tool_choice` "auto", the default with tools, "required" or a named function) is read by it, as vLLM
0.32's server reads them (`vllm/entrypoints/openai/chat_completion/serving.py`, Apache-2.0):
- the parser adjusts the request first (a forced call constrained in the model's own format, or as JSON
  where the parser reads that; Hermes keeps special tokens);
- a stream's deltas go through one parser per choice (`Parser.parse_delta`), a whole output through
  `Parser.parse`, each into content and calls;
- the finish reason is "tool_calls" where "auto" called a tool, or a "required" output stopped by itself
  (streamed: where a call was streamed and the output stopped by itself, a named call's excepted);
- with `parallel_tool_calls` false only the first call is kept.

A model without a parser refuses "auto" (vLLM's 400) and forces its calls as JSON (`tools.ToolCalling`).
vLLM is imported only where a model has a parser, when the router starts (a bad parser name, or one the
model's tokenizer cannot serve, stops it there, as it stops vLLM's server).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmesh.engine.models import resolve_model
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import InvalidRequest

from .openai_api import validation_error
from .tools import AUTO_REFUSED

if TYPE_CHECKING:
    from .openai_api import ChatCompletionRequest

# what of a request vLLM's parsers read, besides its model and messages
_PARSED_FIELDS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "structured_outputs",
    "response_format",
    "skip_special_tokens",
    "chat_template_kwargs",
}


class ToolParsers:
    """Each catalogue model's parser and tokenizer, loaded once."""

    def __init__(self, catalogue: Iterable[ServedModel], model_dir: Path):
        self._models = {m.name: _ModelParser(m, model_dir) for m in catalogue if m.tool_call_parser}

    def calling(self, body: ChatCompletionRequest) -> ParsedToolCalls | None:
        """How the request's calls are read: by its model's parser, its request adjusted by it; None where
        the output cannot call tools or the model has no parser (vLLM's 400 for "auto" there)."""
        if not body.tools or body.tool_choice == "none":
            return None
        model = self._models.get(body.model)
        if model is None:
            if body.auto_tools:
                raise InvalidRequest(AUTO_REFUSED, param="tool_choice")
            return None
        return model.calling(body)


class _ModelParser:
    def __init__(self, served: ServedModel, model_dir: Path):
        from vllm.parser import ParserManager
        from vllm.tokenizers import get_tokenizer

        self.tokenizer = get_tokenizer(resolve_model(served.model, model_dir))
        try:
            parser_class = ParserManager.get_parser(
                tool_parser_name=served.tool_call_parser,
                enable_auto_tools=True,
                model_name=served.model,
                tokenizer=self.tokenizer,
            )
        except TypeError as exc:  # (vLLM's startup errors: an unknown parser, or the tokenizer lacks its tokens)
            raise ValueError(f"model {served.name!r}: tool_call_parser {served.tool_call_parser!r}: {exc}") from exc
        assert parser_class is not None  # (a tool parser is named)
        self.parser_class = parser_class

    def calling(self, body: ChatCompletionRequest) -> ParsedToolCalls:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

        try:
            request = VllmRequest.model_validate(
                body.model_dump(mode="json", by_alias=True, exclude_none=True, include=_PARSED_FIELDS)
            )
        except ValidationError as exc:  # (vLLM's server refuses these before its parser sees them)
            raise validation_error([dict(e) for e in exc.errors()]) from exc
        template_kwargs, given = body.template_kwargs(), request.structured_outputs
        request = self.parser(request.tools, template_kwargs).adjust_request(request)
        if request.structured_outputs is not given:  # the parser's constraint (the calls' format)
            fields = dataclasses.asdict(request.structured_outputs)
            structured: dict[str, Any] | None = {
                k: v for k, v in fields.items() if v is not None and not k.startswith("_")
            }
        else:  # none (a parser that reads a forced call in the model's format unconstrained): the request's own
            structured = body.requested_structure()
        update = {"skip_special_tokens": request.skip_special_tokens, "structured": structured}
        return ParsedToolCalls(self, request, template_kwargs, update)

    def parser(self, tools: Any, template_kwargs: dict[str, Any]) -> Any:
        """A parser of one output (vLLM's parsers keep each stream's state)."""
        return self.parser_class(self.tokenizer, tools, chat_template_kwargs=template_kwargs)


class ParsedToolCalls:
    """One request's reading of its choices' calls."""

    def __init__(
        self, model: _ModelParser, request: Any, template_kwargs: dict[str, Any], sampling_update: dict[str, Any]
    ):
        """`request`: vLLM's, as the parser adjusted it; `sampling_update`: SamplingOptions' fields as it did."""
        self.model, self.request, self.template_kwargs = model, request, template_kwargs
        self.sampling_update = sampling_update
        choice = request.tool_choice
        self.required, self.named = choice == "required", not isinstance(choice, str | None)

    def parser(self) -> Any:
        return self.model.parser(self.request.tools, self.template_kwargs)

    def kept(self, calls: list[Any]) -> list[Any]:
        return calls[:1] if self.request.parallel_tool_calls is False else calls

    def stream(self) -> ParsedToolStream:
        return ParsedToolStream(self, self.parser())

    def answer(self, text: str, token_ids: Sequence[int], reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole output's message and finish reason."""
        from vllm.renderers.chat_utils import make_tool_call_id

        _, content, calls = self.parser().parse(
            text, self.request, enable_auto_tools=True, model_output_token_ids=token_ids
        )
        tool_calls = [
            {
                "id": c.id or make_tool_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in self.kept(calls or [])
        ]
        if self.required or self.named:
            finish = "tool_calls" if self.required and reason == "stop" else reason
            return {"role": "assistant", "content": content or "", "tool_calls": tool_calls}, finish
        if not tool_calls:
            return {"role": "assistant", "content": content}, reason
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"


class ParsedToolStream:
    """One choice's streamed output, read delta by delta."""

    def __init__(self, calling: ParsedToolCalls, parser: Any):
        self.calling, self.parser = calling, parser
        self.called = False  # a call has been streamed

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any]:
        """The chat delta's fields (content, tool_calls) this text makes; none while the parser holds it."""
        message = self.parser.parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self.calling.request,
            prompt_token_ids=[],  # (read only to start a reasoning parser, and there is none)
            finished=finished,
        )
        if message is None:
            return {}
        self.called = self.called or bool(message.tool_calls)
        delta = message.model_dump(exclude_unset=True)  # (as vLLM renders its chunks)
        if delta.get("tool_calls") and self.calling.request.parallel_tool_calls is False:
            delta["tool_calls"] = [c for c in delta["tool_calls"] if c["index"] == 0]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called and not self.calling.named and reason == "stop" else reason
