"""tool_choice "auto" (the default with tools): a chat's output, which may call tools in its model's own
format, read back by vLLM's parser of that format (a catalogue model's `tool_call_parser`, vLLM's
`--tool-call-parser`). It runs here, in the router, which sees each choice's whole output whichever engines
generated it.

As vLLM 0.32's server does it (`vllm/entrypoints/openai/chat_completion/serving.py`, Apache-2.0):
- the parser adjusts the request first (some keep special tokens, some constrain the calls' format);
- a stream's deltas go through one parser per choice (`Parser.parse_delta`), a whole output through
  `Parser.parse`, each into content and calls;
- a choice whose output called a tool finishes with "tool_calls" (streamed: where it stopped by itself);
- with `parallel_tool_calls` false only the first call is kept.

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


class AutoToolParsers:
    """Each catalogue model's parser and tokenizer, loaded once."""

    def __init__(self, catalogue: Iterable[ServedModel], model_dir: Path):
        self._models = {m.name: _ModelParser(m, model_dir) for m in catalogue if m.tool_call_parser}

    def calling(self, body: ChatCompletionRequest) -> AutoToolCalling:
        """The request's reading of calls, its request adjusted by the model's parser (vLLM's error where the
        model has none)."""
        model = self._models.get(body.model)
        if model is None:
            raise InvalidRequest(AUTO_REFUSED, param="tool_choice")
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

    def calling(self, body: ChatCompletionRequest) -> AutoToolCalling:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

        try:
            request = VllmRequest.model_validate(
                body.model_dump(mode="json", by_alias=True, exclude_none=True, include=_PARSED_FIELDS)
            )
        except ValidationError as exc:  # (vLLM's server refuses these before its parser sees them)
            raise validation_error([dict(e) for e in exc.errors()]) from exc
        calling = AutoToolCalling(self, request, body.template_kwargs())
        given = request.structured_outputs
        request = calling.parser().adjust_request(request)
        calling.request = request
        calling.sampling_update["skip_special_tokens"] = request.skip_special_tokens
        if request.structured_outputs is not given:  # the parser's constraint (the calls' format)
            fields = dataclasses.asdict(request.structured_outputs)
            calling.sampling_update["structured"] = {
                k: v for k, v in fields.items() if v is not None and not k.startswith("_")
            }
        return calling


class AutoToolCalling:
    """One request's reading of its choices' calls."""

    def __init__(self, model: _ModelParser, request: Any, template_kwargs: dict[str, Any]):
        self.model, self.request, self.template_kwargs = model, request, template_kwargs
        self.sampling_update: dict[str, Any] = {}  # SamplingOptions' fields as the parser adjusted them

    def parser(self) -> Any:
        """A parser of one output (vLLM's parsers keep each stream's state)."""
        return self.model.parser_class(
            self.model.tokenizer, self.request.tools, chat_template_kwargs=self.template_kwargs
        )

    @property
    def single(self) -> bool:
        return self.request.parallel_tool_calls is False

    def stream(self) -> AutoToolStream:
        return AutoToolStream(self, self.parser())

    def answer(self, text: str, token_ids: Sequence[int], reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole output's message and finish reason."""
        from vllm.renderers.chat_utils import make_tool_call_id

        _, content, calls = self.parser().parse(
            text, self.request, enable_auto_tools=True, model_output_token_ids=token_ids
        )
        if not calls:
            return {"role": "assistant", "content": content}, reason
        tool_calls = [
            {
                "id": c.id or make_tool_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in (calls[:1] if self.single else calls)
        ]
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"


class AutoToolStream:
    """One choice's streamed output, read delta by delta."""

    def __init__(self, calling: AutoToolCalling, parser: Any):
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
        if self.calling.single and delta.get("tool_calls"):
            delta["tool_calls"] = [c for c in delta["tool_calls"] if c["index"] == 0]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called and reason == "stop" else reason
