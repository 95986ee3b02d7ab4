"""OpenAI's and vLLM's request bodies (the supported subset), validated: what the router reads of a request."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any, Literal, NamedTuple, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    field_validator,
    model_validator,
)

from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import ChatMessage, LoraAdapter, RepetitionDetection, SamplingOptions, TokenizePrompt

from .tools import NamedToolChoice, Tool, ToolCallIn, ToolCalling, tool_calling

_FORM = "form:"  # tags a body's form in a union of forms (left out of its errors' paths)
# What the bus carries (MessagePack's integers): larger numbers are a 400 here, not a failure to encode.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
PositiveInt64 = Annotated[int, Field(ge=1, le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1)]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_CHOICES = 128  # OpenAI's limit on n (each choice is a request of its own to admission and the workers)
MAX_GENERATIONS = 256  # prompts × n in one request
MAX_TOOLS = 128  # OpenAI's limit on tools
MAX_DETOKENIZED = 1 << 18  # token ids a /detokenize takes (its message to a worker stays far under NATS's payload)
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's limit
MAX_BAD_WORDS = 128  # vLLM's default limit (VLLM_MAX_NUM_BAD_WORDS, on their tokenizations: the workers apply it)

# Fields of OpenAI's and vLLM's APIs that change what is generated and that the mesh does not do: any value but
# the ones listed (their defaults) is refused, never ignored. Other unknown fields are ignored, as vLLM does.
_GUIDED = "removed from vLLM: use structured_outputs or response_format"
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((1,), "one sequence is generated a request"),
    "use_beam_search": ((False,), "one sequence is generated a request"),
    "suffix": (("",), "insertion is not done"),
    "guided_json": ((), _GUIDED),
    "guided_regex": ((), _GUIDED),
    "guided_choice": ((), _GUIDED),
    "guided_grammar": ((), _GUIDED),
    "tools": ((), "tools are for chat completions"),
    "tool_choice": (("none",), "tools are for chat completions"),
    "chat_template": ((), "a request's own chat template is refused, as by vLLM's server by default"),
    "watermarking": ((), "not done"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "vllm_xargs": (({},), "custom logits processors' arguments are not passed on"),
}


def refuse_unsupported(data: Any, names: Iterable[str]) -> Any:
    """A 400 naming the first of `names` (UNSUPPORTED's) given another value, not a 200 that ignored it
    (raised as is: pydantic passes it through)."""
    for name in names:
        accepted, reason = UNSUPPORTED[name]
        value = data.get(name) if isinstance(data, dict) else None
        if value is not None and value not in accepted:
            raise InvalidRequest(f"{name}={json.dumps(value)[:100]} is not supported ({reason})", param=name)
    return data


def _thinking_token_budget(value: Any) -> int | None:
    """vLLM's rule: a non-negative integer, or -1 (None) for no budget."""
    if value is None or (type(value) is int and value == -1):
        return None
    if type(value) is not int or not 0 <= value < 2**63:
        raise InvalidRequest(
            "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
            param="thinking_token_budget",
        )
    return value


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one constraint (json, regex, choice, grammar or json_object), and options."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None  # EBNF (GBNF, Lark)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [
            name
            for name in ("json_schema", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:  # (vLLM's rule)
            raise InvalidRequest(
                "structured output takes exactly one of json, regex, choice, grammar and json_object"
                + (f", not {len(given)}" if given else ""),
                param="structured_outputs",
            )
        return self


class _JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (vLLM's structural tags are not done)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:  # (vLLM's error)
            raise InvalidRequest(
                "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                param="response_format",
            )
        return self


class Prompt(NamedTuple):
    """One prompt of a request, in one of its forms (the others None)."""

    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
    tools: list[dict[str, Any]] | None = None  # a chat's tools, for its template
    template_kwargs: dict[str, Any] | None = None  # a chat's other template variables
    add_special_tokens: bool | None = None  # None: the endpoint's default


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI fields are accepted and ignored

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


class _Common(_Body):
    model: str
    max_tokens: PositiveInt64 | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    top_k: int = Field(default=0, ge=-1, le=2**63 - 1)  # vLLM extension: 0 or -1 for every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM extension
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # vLLM extension: on prompt and output alike
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)  # null: 0, as OpenAI's default
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0, le=2**63 - 1)  # vLLM extension: no end of sequence before this many tokens
    # token id -> added to its logit, clamped to [-100, 100] as OpenAI does
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    stop_token_ids: list[TokenId] = Field(default=[], max_length=300)  # vLLM extension: they end the output
    include_stop_str_in_output: bool = False  # vLLM extension: the stop string or token's text kept at the end
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM extension: completion token ids in each choice
    cache_salt: str | None = None  # vLLM extension: prefix-cache isolation between tenants
    ignore_eos: bool = False  # vLLM extension: generate max_tokens even past EOS (benchmarks use it)
    priority: Int64 = 0  # vLLM extension: lower is more urgent (read by the dispatch policy)
    ttft_slo_ms: float | None = Field(default=None, gt=0)  # mesh extension: this request's time-to-first-token target
    tpot_slo_ms: float | None = Field(default=None, gt=0)  # mesh extension: its time-per-output-token target
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM extension
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)  # vLLM extension
    return_tokens_as_token_ids: bool = False  # vLLM extension: logprobs' tokens as "token_id:<id>"
    skip_special_tokens: bool = True  # vLLM extension: false shows special tokens' text
    spaces_between_special_tokens: bool = True  # vLLM extension: false joins added tokens' text (those shown)
    bad_words: list[str] = Field(default=[], max_length=MAX_BAD_WORDS)  # vLLM extension: words never generated
    # vLLM extension: these tokens' logprobs with each output token, instead of the likeliest (needs logprobs)
    logprob_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_LOGPROB_TOKEN_IDS)
    # vLLM extension: each prompt token's logprob and rank, with this many of the likeliest (not streamed)
    prompt_logprobs: int | None = None
    # vLLM extension: keep this many prompt tokens (-1: as many as the context allows), from the end `truncation_side`
    # names ("left" keeps the last ones; None: the tokenizer's side)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM extension: reasoning tokens before a model with a reasoning parser is made to end its reasoning
    thinking_token_budget: Annotated[int | None, BeforeValidator(_thinking_token_budget)] = None
    # vLLM extension: the output ends ("repetition") where its last tokens repeat so
    repetition_detection: RepetitionDetection | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, [name for name in UNSUPPORTED if name not in cls.model_fields])  # (its: done)

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, salt: str | None) -> str | None:
        """vLLM's rules, so a client moving between vLLM and the mesh sees the same errors."""
        if salt is not None and (not salt or len(salt) > 128 or any(c in "@/\\\0" for c in salt)):
            raise ValueError("cache_salt must be 1 to 128 characters and must not contain '@', '/', '\\' or NUL")
        return salt

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > 300:
            raise ValueError("at most 300 tokens")  # OpenAI's limit
        if not all(key.isascii() and key.isdigit() and int(key) < 2**63 for key in bias):
            raise ValueError("keys must be token ids")
        return {str(int(key)): min(max(value, -100.0), 100.0) for key, value in bias.items()}

    @model_validator(mode="after")
    def _stream_options(self) -> _Common:
        if self.stream_options is not None and not self.stream:  # (vLLM's error)
            raise InvalidRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
        return self

    @model_validator(mode="after")
    def _choice_seeds(self) -> _Common:
        if self.seed is not None and self.seed + self.n - 1 > 2**63 - 1:
            raise InvalidRequest("seed + n - 1 must fit in 64 bits (choice i samples with seed + i)", param="seed")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs(self) -> _Common:  # (vLLM's rules and words)
        asked = self.prompt_logprobs
        if asked is None:
            return self
        if asked < -1:
            raise InvalidRequest("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
        if self.stream and asked != 0:
            raise InvalidRequest("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        if asked == -1 or asked > MAX_LOGPROBS:
            shown = "every token's (-1)" if asked == -1 else str(asked)
            raise InvalidRequest(
                f"Requested prompt logprobs of {shown}, which is greater than max allowed: {MAX_LOGPROBS}",
                param="prompt_logprobs",
            )
        return self

    @model_validator(mode="after")
    def _logprob_token_ids(self) -> _Common:
        if self.logprob_token_ids and self.logprob_count is None:  # (vLLM's words)
            raise InvalidRequest("when using `logprob_token_ids`, `logprobs` must be set.", param="logprob_token_ids")
        return self

    @property
    def shown_logprobs(self) -> int | None:
        """How many candidates after each output token's own its logprobs show (None: no logprobs): every
        requested id's with `logprob_token_ids`."""
        if self.logprob_count is None or not self.logprob_token_ids:
            return self.logprob_count
        return MAX_LOGPROB_TOKEN_IDS + 1

    @model_validator(mode="after")
    def _min_tokens(self) -> _Common:
        if self.min_tokens and self.stop:
            raise InvalidRequest("min_tokens with stop strings is not supported", param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", param="min_tokens"
            )
        return self

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
            max_tokens=1 if self.max_tokens == 0 else self.max_tokens,  # 0: an echo's prompt alone, after 1 token
            temperature=self.temperature,
            top_p=self.top_p,
            stop=stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias or {},
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprob_count,
            logprob_token_ids=self.logprob_token_ids or None,
            echo=self.echoes,
            prompt_logprobs=self.prompt_logprobs,
            prompt_text=self.shows_prompt_text,
            structured=self.structured(),
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            bad_words=self.bad_words,
            thinking_token_budget=self.thinking_token_budget,
            repetition_detection=self.repetition_detection,
        )

    def structured(self) -> dict[str, Any] | None:
        """vLLM's StructuredOutputsParams fields: a forced call's constraint, else the request's own."""
        if self.tool_calling is not None:  # (vLLM's: the call's constraint replaces theirs)
            return self.tool_calling.constraint()
        return self.requested_structure()

    def requested_structure(self) -> dict[str, Any] | None:
        """vLLM's StructuredOutputsParams fields, from `structured_outputs` or `response_format`."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            given = self.structured_outputs
            return given.model_dump(by_alias=True, exclude_none=True) if given is not None else None
        if self.structured_outputs is not None:  # (vLLM's rule: one constraint)
            raise InvalidRequest(
                "response_format and structured_outputs each give a constraint: give one", param="response_format"
            )
        if fmt.type == "json_object":
            return {"json_object": True}
        assert fmt.json_schema is not None  # (validated)
        return {"json": fmt.json_schema.json_schema}

    @model_validator(mode="after")
    def _one_structure(self) -> _Common:
        self.structured()
        return self

    def choice_samplings(self) -> list[SamplingOptions]:
        """One a choice: choice i samples with seed + i, as vLLM's parallel sampling does (so choice i of a
        seeded request is what a request for one choice with seed + i gives)."""
        options = self.sampling()
        if options.seed is None:
            return [options] * self.n
        return [options.model_copy(update={"seed": options.seed + i}) for i in range(self.n)]

    @property
    def logprob_count(self) -> int | None:
        """How many of the likeliest tokens each output token comes with; None: no logprobs."""
        return None

    @property
    def tool_calling(self) -> ToolCalling | None:
        """The call the output is forced to make (None: the output is text)."""
        return None

    def inputs(self) -> list[Prompt]:
        """The request's prompts, in order (several for completions given a list of them)."""
        raise NotImplementedError

    @property
    def echoes(self) -> bool:
        """Whether each choice's text (and logprobs) begins with its prompt's."""
        return False

    @property
    def shows_prompt_text(self) -> bool:
        """Whether the answer shows the rendered prompt's text (vLLM's `return_prompt_text`, a chat's)."""
        return False

    @property
    def chat_echo(self) -> str | None:
        """The text a chat's answer begins with (vLLM's chat `echo`); None: none."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """Each streamed chunk with its choice's usage so far (vLLM's `continuous_usage_stats`, with usage)."""
        return self.include_usage and bool((self.stream_options or {}).get("continuous_usage_stats"))


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]  # one prompt or several, each a text or token ids
    max_tokens: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = 16  # 0 with echo: the prompt alone, as vLLM
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # with logprobs, the prompt's too (its first token has none): how evaluation harnesses score
    add_special_tokens: bool = True  # vLLM extension: the tokenizer's (its BOS) before a text prompt

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def echoes(self) -> bool:
        return self.echo

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)  # type: ignore[arg-type]
        return [list(self.prompt)]  # type: ignore[arg-type]

    def inputs(self) -> list[Prompt]:
        return [
            Prompt(p, None, None, add_special_tokens=self.add_special_tokens)
            if isinstance(p, str)
            else Prompt(None, p, None)
            for p in self.prompts
        ]

    @model_validator(mode="after")
    def _nothing_generated_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest(
                "max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens"
            )
        return self

    @model_validator(mode="after")
    def _generations(self) -> CompletionRequest:
        if len(self.prompts) * self.n > MAX_GENERATIONS:
            raise InvalidRequest(f"prompts × n must not exceed {MAX_GENERATIONS}", param="n")
        return self


class _ChatPart(BaseModel):
    type: Literal["text"]
    text: str


class _ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[_ChatPart] | None = None  # None: empty (an assistant turn that called tools)
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's
    name: str | None = None
    reasoning: str | None = None  # an assistant turn's, as vLLM's server gave it (its template may show it)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, not {str(part.get('type'))[:40]!r}")
        return content

    def to_message(self) -> ChatMessage:
        """Text parts joined by newlines, as vLLM joins them for a chat template that takes text; tool
        calls as templates take them (an assistant's; none where it made none, as vLLM drops an empty list)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or ())
        return ChatMessage(
            role="system" if self.role == "developer" else self.role,
            content=content,
            tool_calls=[c.for_template() for c in self.tool_calls or ()] or None if self.role == "assistant" else None,
            tool_call_id=self.tool_call_id if self.role == "tool" else None,
            name=self.name,
            reasoning=self.reasoning if self.role == "assistant" else None,
        )


class _ChatPrompt(_Body):
    """A chat's messages, tools and template variables: what renders its prompt (a chat completion's, or
    /tokenize's of the same fields)."""

    messages: list[_ChatMessageIn] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    # vLLM extensions: the chat template's variables
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the tokenizer's, besides the template's (vLLM's default: no)

    @model_validator(mode="after")
    def _template_variables(self) -> Self:
        """vLLM's checks."""
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        if unexpected := {"chat_template", "tokenize"} & (self.chat_template_kwargs or {}).keys():
            raise InvalidRequest(
                f"Found unexpected chat template kwargs from request: {unexpected}", param="chat_template_kwargs"
            )
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables besides messages and tools, merged as vLLM's server merges them: the
        request's fields over its chat_template_kwargs (unset ones not), and enable_thinking from
        reasoning_effort unless given."""
        given = self.chat_template_kwargs or {}
        fields = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "documents": self.documents,
            "reasoning_effort": self.reasoning_effort,
        }
        if self.reasoning_effort is not None and "enable_thinking" not in given:
            fields["enable_thinking"] = self.reasoning_effort != "none"
        return given | {k: v for k, v in fields.items() if v not in (None, "auto")}

    def chat_prompt(self) -> Prompt:
        tools = [t.model_dump() for t in self.tools] if self.tools else None
        messages = [m.to_message() for m in self.messages]
        return Prompt(None, None, messages, tools, self.template_kwargs(), self.add_special_tokens)


class ChatCompletionRequest(_Common, _ChatPrompt):
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # read with logprobs alone, as vLLM does
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # vLLM extension: false leaves the reasoning out (a model with a reasoning parser)
    return_prompt_text: bool | None = None  # vLLM extension: the rendered template's text (the first chunk's)
    echo: bool = False  # vLLM extension: the last message's content before the output, where its role is the answer's
    _tool_calling: ToolCalling | None = PrivateAttr(default=None)

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_calling(self) -> ToolCalling | None:
        return self._tool_calling

    @property
    def shows_prompt_text(self) -> bool:
        return bool(self.return_prompt_text)

    @property
    def chat_echo(self) -> str | None:
        """vLLM's: the last message's text where its role is the answer's ("assistant" with a generation prompt,
        else the last message's own)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return None
        return last.to_message().content or None

    @property
    def auto_tools(self) -> bool:
        """Whether the output may call tools in the model's own format or answer in text (tool_choice "auto",
        the default with tools), which needs the model's parser (`parsed_output`)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        self._tool_calling = tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.tool_calling is not None and self.tool_calling.function is not None and self.structured_outputs:
            raise InvalidRequest(  # (vLLM's rule)
                "You can only either use constraints for structured outputs or tools, not both.",
                param="structured_outputs",
            )
        return self

    def inputs(self) -> list[Prompt]:
        return [self.chat_prompt()]

    @model_validator(mode="before")
    @classmethod
    def _max_completion_tokens(cls, data: Any) -> Any:
        """OpenAI's newer name for max_tokens (max_tokens wins where both are given)."""
        if isinstance(data, dict) and data.get("max_tokens") is None and "max_completion_tokens" in data:
            return {**data, "max_tokens": data["max_completion_tokens"]}
        return data


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize of a text; `model` may be left out where the mesh has one."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    def query(self, model: str) -> TokenizePrompt:
        return TokenizePrompt(
            model=model,
            prompt=self.prompt,
            add_special_tokens=self.add_special_tokens,
            token_strs=bool(self.return_token_strs),
        )


class TokenizeChatRequest(_ChatPrompt):
    """vLLM's /tokenize of a chat: the prompt its chat completion gets (documents and reasoning_effort too)."""

    model: str | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, ["chat_template"])

    def query(self, model: str) -> TokenizePrompt:
        return TokenizePrompt(model=model, **self.chat_prompt()._asdict(), token_strs=bool(self.return_token_strs))


def _tokenize_form(data: Any) -> str:
    return _FORM + ("chat" if isinstance(data, dict) and "messages" in data else "text")


# vLLM's /tokenize body: a chat where it has messages, a text otherwise
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag(_FORM + "chat")] | Annotated[TokenizeCompletionRequest, Tag(_FORM + "text")],
    Discriminator(_tokenize_form),
]


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids to the tokenizer's text of them."""

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZED)


class LoadLoraAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter; `base_model_name` (as in vLLM's --lora-modules) names the model it adapts
    where the mesh has several."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None

    def adapter(self) -> LoraAdapter:
        return LoraAdapter(name=self.lora_name, path=self.lora_path)


class UnloadLoraAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1, max_length=256)


def validation_error(errors: list[dict[str, Any]]) -> InvalidRequest:
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query") and not str(p).startswith(_FORM)]
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return InvalidRequest(f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}")
    return InvalidRequest(f"{'.'.join(loc) or 'body'}: {msg}", param=".".join(loc) or None)
