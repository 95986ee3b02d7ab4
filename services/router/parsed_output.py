"""A chat's output read by vLLM's parsers of a model's own formats: a catalogue model's `tool_call_parser`
(vLLM's `--tool-call-parser` with `--enable-auto-tool-choice`) and `reasoning_parser` (`--reasoning-parser`).
They run here, in the router, which sees each choice's whole output whichever engines generated it. Every chat
for such a model is read by them, as vLLM 0.32's server reads it
(`vllm/entrypoints/openai/chat_completion/serving.py`, `vllm/renderers/online_renderer.py`, Apache-2.0):
- the parser adjusts the request first where it reads reasoning or the output may call tools (a forced call
  constrained in the model's own format, or as JSON where the parser reads that; Hermes keeps special tokens);
- a stream's deltas go through one parser per choice (`Parser.parse_delta`, told the prompt, which may have
  ended the reasoning), a whole output through `Parser.parse`, each into reasoning, content and calls;
- `include_reasoning` false drops the reasoning, and the choice's logprobs and token ids with it (they would
  show it); usage counts the reasoning tokens (`completion_tokens_details`) where the model has a parser of it;
- the finish reason is "tool_calls" where "auto" called a tool, or a "required" output stopped by itself
  (streamed: where a call was streamed and the output stopped by itself, a named call's excepted);
- with `parallel_tool_calls` false only the first call is kept.

A model with a reasoning parser and no tool-call parser forces its calls as JSON (`tools.ToolCalling`), read
from the content past the reasoning (vLLM's server reads none there). A model without a tool-call parser
refuses "auto" (vLLM's 400). A structured output (a forced call's too) of a model with a reasoning parser starts
where the reasoning ends: its engines hold the constraint till then (`ReasoningGate`, llmesh.engine.reasoning).
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
from llmesh.wire.messages import ReasoningGate

from .schemas import validation_error
from .tools import AUTO_REFUSED, ToolCalling

if TYPE_CHECKING:
    from .schemas import ChatCompletionRequest

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
    "include_reasoning",
}


class OutputParsers:
    """Each catalogue model's parser and tokenizer, loaded once."""

    def __init__(self, catalogue: Iterable[ServedModel], model_dir: Path):
        self._models = {
            m.name: _ModelParser(m, model_dir) for m in catalogue if m.tool_call_parser or m.reasoning_parser
        }

    def reading(self, body: ChatCompletionRequest, model_name: str | None = None) -> ParsedOutput | None:
        """How the request's output is read: by its model's parsers (`model_name`'s, where its `model` names a
        LoRA adapter: the adapted model's), its request adjusted by them; None where the model has none (its
        output is text, or forced calls: vLLM's 400 for "auto" there)."""
        model = self._models.get(model_name or body.model)
        if body.auto_tools and (model is None or not model.reads_calls):
            raise InvalidRequest(AUTO_REFUSED, param="tool_choice")
        return None if model is None else model.reading(body)


class _ModelParser:
    def __init__(self, served: ServedModel, model_dir: Path):
        from vllm.parser import ParserManager
        from vllm.tokenizers import get_tokenizer

        args = served.tokenizer_args()  # (as its engines load it)
        self.tokenizer = get_tokenizer(**args | {"tokenizer_name": resolve_model(args["tokenizer_name"], model_dir)})
        self.reads_calls, self.reasons = served.tool_call_parser is not None, served.reasoning_parser is not None
        try:
            parser_class = ParserManager.get_parser(
                tool_parser_name=served.tool_call_parser,
                reasoning_parser_name=served.reasoning_parser,
                enable_auto_tools=self.reads_calls,
                model_name=served.model,
                tokenizer=self.tokenizer,
            )
        # (vLLM's startup errors: an unknown parser, or the tokenizer lacks its tokens)
        except (TypeError, KeyError, RuntimeError) as exc:
            named = {"tool_call_parser": served.tool_call_parser, "reasoning_parser": served.reasoning_parser}
            given = ", ".join(f"{k} {v!r}" for k, v in named.items() if v)
            raise ValueError(f"model {served.name!r}: {given}: {exc}") from exc
        assert parser_class is not None  # (a parser is named)
        self.parser_class = parser_class

    def reading(self, body: ChatCompletionRequest) -> ParsedOutput:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

        try:
            request = VllmRequest.model_validate(
                body.model_dump(mode="json", by_alias=True, exclude_none=True, include=_PARSED_FIELDS)
            )
        except ValidationError as exc:  # (vLLM's server refuses these before its parser sees them)
            raise validation_error([dict(e) for e in exc.errors()]) from exc
        template_kwargs, given = body.template_kwargs(), request.structured_outputs
        if self.reasons or request.tool_choice != "none":  # (vLLM's renderer's rule)
            request = self.parser(request.tools, template_kwargs).adjust_request(request)
        structured: dict[str, Any] | None
        if (constraint := request.structured_outputs) is not given and constraint is not None:  # the parser's own
            fields = dataclasses.asdict(constraint)
            structured = {k: v for k, v in fields.items() if v is not None and not k.startswith("_")}
        elif self.reads_calls:  # none (a parser that reads a forced call in the model's format unconstrained)
            structured = body.requested_structure()
        else:  # forced calls as JSON, or the request's own
            structured = body.structured()
        update: dict[str, Any] = {"skip_special_tokens": request.skip_special_tokens, "structured": structured}
        if self.reasons and structured is not None:
            # vLLM's `reasoning_ended` where the request decides it: True (no reasoning shown, or the parser's
            # own grammar) constrains the whole output; else its prompt and output decide (the engines')
            from_start = request.resolve_reasoning_ended(None, []) is True
            update["reasoning"] = ReasoningGate(from_start=from_start, chat_template_kwargs=template_kwargs)
        return ParsedOutput(self, request, template_kwargs, update, None if self.reads_calls else body.tool_calling)

    def parser(self, tools: Any, template_kwargs: dict[str, Any]) -> Any:
        """A parser of one output (vLLM's parsers keep each stream's state)."""
        return self.parser_class(self.tokenizer, tools, chat_template_kwargs=template_kwargs)


class ParsedOutput:
    """One request's reading of its choices' outputs."""

    def __init__(
        self,
        model: _ModelParser,
        request: Any,
        template_kwargs: dict[str, Any],
        sampling_update: dict[str, Any],
        forced: ToolCalling | None,
    ):
        """`request`: vLLM's, as the parser adjusted it; `sampling_update`: SamplingOptions' fields as it did;
        `forced`: calls forced as JSON, read from the content (a model without a tool-call parser)."""
        self.model, self.request, self.template_kwargs = model, request, template_kwargs
        self.sampling_update, self.forced = sampling_update, forced
        choice = request.tool_choice
        self.required, self.named = choice == "required", not isinstance(choice, str | None)
        self.hides_tokens = not request.include_reasoning  # (vLLM's: logprobs and token ids would show it)

    def parser(self) -> Any:
        return self.model.parser(self.request.tools, self.template_kwargs)

    def kept(self, calls: list[Any]) -> list[Any]:
        return calls[:1] if self.request.parallel_tool_calls is False else calls

    def reasoning_tokens(self, parser: Any, token_ids: Sequence[int]) -> int | None:
        """The reasoning tokens of an output `parser` read, for usage (None: the model has no parser of its
        reasoning)."""
        return parser.count_reasoning_tokens(tuple(token_ids)) if self.model.reasons else None

    def stream(self, prompt_token_ids: Sequence[int] | None) -> ParsedStream:
        return ParsedStream(self, self.parser(), list(prompt_token_ids or ()))

    def answer(
        self, text: str, token_ids: Sequence[int], reason: str | None, prompt_token_ids: Sequence[int] | None
    ) -> tuple[dict[str, Any], str | None, int | None]:
        """A whole output's message, finish reason and reasoning tokens (None: not counted)."""
        parser = self.parser()
        if prompt_token_ids is not None:  # (as vLLM's server tells a whole output's parser)
            parser.set_prompt_token_ids(prompt_token_ids)
        message, finish = self._answer(parser, text, token_ids, reason)
        return message, finish, self.reasoning_tokens(parser, token_ids)

    def _answer(
        self, parser: Any, text: str, token_ids: Sequence[int], reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        from vllm.renderers.chat_utils import make_tool_call_id

        reasoning, content, calls = parser.parse(
            text, self.request, enable_auto_tools=self.model.reads_calls, model_output_token_ids=token_ids
        )
        shown = {"reasoning": reasoning if self.request.include_reasoning else None} if self.model.reasons else {}
        if self.forced is not None:
            message, finish, _ = self.forced.answer(content or "", (), reason)
            return message | shown, finish
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
            return {"role": "assistant", "content": content or "", "tool_calls": tool_calls} | shown, finish
        if not tool_calls:
            return {"role": "assistant", "content": content} | shown, reason
        return {"role": "assistant", "content": content, "tool_calls": tool_calls} | shown, "tool_calls"


class ParsedStream:
    """One choice's streamed output, read delta by delta."""

    def __init__(self, output: ParsedOutput, parser: Any, prompt_token_ids: list[int]):
        self.output, self.parser, self.prompt_token_ids = output, parser, prompt_token_ids
        self.forced = output.forced.stream() if output.forced is not None else None
        self.called = False  # a call has been streamed
        self.counts_reasoning = output.model.reasons
        self.token_ids: list[int] = []  # the output's so far, for its reasoning tokens (where counted)

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any]:
        """The chat delta's fields (reasoning, content, tool_calls) this text makes; none while the parser
        holds it."""
        if self.counts_reasoning:
            self.token_ids += token_ids
        message = self.parser.parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self.output.request,
            prompt_token_ids=self.prompt_token_ids,  # (read once, at the first delta)
            finished=finished,
        )
        if message is None:
            return {}
        delta = message.model_dump(exclude_unset=True)  # (as vLLM renders its chunks)
        if self.forced is not None:
            delta |= self.forced.delta(delta.pop("content", None) or "")
        self.called = self.called or bool(delta.get("tool_calls"))
        if delta.get("tool_calls") and self.output.request.parallel_tool_calls is False:
            delta["tool_calls"] = [c for c in delta["tool_calls"] if c["index"] == 0]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        if self.forced is not None:
            return self.forced.finish_reason(reason)
        return "tool_calls" if self.called and not self.output.named and reason == "stop" else reason

    def reasoning_tokens(self) -> int | None:
        return self.output.reasoning_tokens(self.parser, self.token_ids)
