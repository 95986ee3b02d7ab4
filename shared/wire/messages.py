"""Every message that crosses the bus, and the one codec that frames them.

Frame: 4-byte big-endian length of a MessagePack header, the header
`{"v": SCHEMA_VERSION, "t": type name, "d": fields}`, then an optional raw blob
(KV bytes travel there, never inside MessagePack, so they are not copied twice).
Types are pydantic models: a malformed or mistyped message fails to decode with
`BadMessage`, never with a crash deeper down. Fields a receiver does not know are ignored, so a
newer sender (a rolling upgrade) does not break an older receiver; new fields get defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, TypeVar, get_args

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmesh.wire.errors import BadMessage, MeshError, from_code

SCHEMA_VERSION = 1
Role = Literal["prefill", "decode"]  # what a worker serves
ROLES: tuple[Role, ...] = get_args(Role)  # a model's, disaggregated
_HEADER_LEN = 4

_TYPES: dict[str, type[Message]] = {}


class Message(BaseModel):
    """Base of every bus message; subclasses register themselves by class name."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[cls.__name__] = cls


M = TypeVar("M", bound=Message)


# ---- generic replies ------------------------------------------------------------


class ErrorReply(Message):
    """A typed failure; `decode` raises it as the matching MeshError."""

    code: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, err: MeshError) -> ErrorReply:
        return cls(code=err.code, message=err.message, param=err.param)


class Ack(Message):
    pass


class StreamEnd(Message):
    """Last message of a reply stream."""


class StreamBatch(Message):
    """Replies to several of one client's streams, sent together: the blob holds one frame per
    stream id, `sizes` bytes each (`split_batch`)."""

    streams: list[str]
    sizes: list[int]


# ---- discovery and load ------------------------------------------------------------


def kv_blocks(tokens: int, block_size: int) -> int:
    """KV blocks that `tokens` tokens fill."""
    return -(-tokens // max(block_size, 1))


class RequestProgress(Message):
    """A request a worker holds, as its heartbeat reports it: what the policies, placement and the
    simulator read of it (the worker builds it from its own record by field name, `HeldRequest`)."""

    request_id: str
    prompt_tokens: int
    generated: int = 0  # output tokens so far
    max_tokens: int = 0  # output budget
    predicted_tokens: float | None = None
    priority: int = 0  # vLLM's convention: lower is more urgent
    migrating: bool = False  # being handed over to another worker
    # the length predictor's refined estimate of the output still to come, made when `generated` was
    # `remaining_at` (LengthRemainingRequest); None: none yet, or the predictor had no information
    predicted_remaining: float | None = None
    remaining_at: int = 0

    @property
    def expected_remaining(self) -> float:
        """Output tokens still to come, by the best estimate at hand: the refined one, else the
        prompt-only prediction, else the budget."""
        budget = self.max_tokens - self.generated
        if self.predicted_remaining is not None:
            estimate = self.predicted_remaining - (self.generated - self.remaining_at)
        elif self.predicted_tokens is not None:
            estimate = self.predicted_tokens - self.generated
        else:
            return float(budget)
        return float(min(max(estimate, 1.0), budget))

    def kv_blocks(self, block_size: int) -> int:
        """Blocks its KV fills now."""
        return kv_blocks(self.prompt_tokens + self.generated, block_size)

    @property
    def prefilling(self) -> bool:
        """Its prompt is not computed yet (no output token)."""
        return self.generated == 0


class WorkerInfo(Message):
    """Heartbeat a worker publishes every `heartbeat_s` on `subjects.HEARTBEAT`."""

    worker_id: str
    role: Role
    model: str
    fingerprint: str  # KV layout identity; prefill and decode must match
    max_model_len: int
    running: int  # requests in the engine
    queued_tokens: int  # prompt tokens (prefill) or remaining output budget (decode) in flight
    capacity: int  # requests it accepts concurrently
    heartbeat_s: float
    prefill_tokens_per_s: float = 0.0  # prompt tokens it computes per second of prefill work (0: not measured yet)
    generates: bool = False  # decode workers: also runs whole requests (`Subjects.generate`), prefill included
    state: Literal["active", "draining"] = "active"
    kv_blocks_used: int = 0  # the engine's KV blocks in use (prefix-cached blocks held by no request are free)
    kv_blocks_total: int = 0  # 0: not reported
    block_size: int = 0
    requests: list[RequestProgress] = Field(default_factory=list)
    preemptions: dict[str, int] = Field(default_factory=dict)  # KV of preempted requests: times swapped in / recomputed
    roles: list[Role] = Field(default_factory=list)  # it can serve (both: `role` is switchable)
    host: str = ""  # the host it runs on (a host agent's id: MESH_HOST_ID)
    memory_bytes: int = 0  # what its engine holds: weights and KV space (0: not reported)
    weights_bytes: int = 0  # of which its weights' (0: not reported)
    adapters: dict[str, str] = Field(default_factory=dict)  # LoRA adapters it serves: name -> folder
    loaded_adapters: list[str] = Field(default_factory=list)  # of which its engine holds these loaded now


# ---- output-length prediction ----------------------------------------------------------


class LengthPredictRequest(Message):
    """Predict a request's output length from its prompt text (chat: the user's turns).

    A sender may cut a long prompt (`llmesh.wire.lengths.cut_prompt`) and give its full length in
    `prompt_chars`; the predictor cuts anything longer itself.
    """

    request_id: str = ""  # names the prediction in the decode worker's LengthObserved report
    prompt: str
    prompt_chars: int | None = Field(default=None, ge=0)
    model: str = ""  # the served model that will answer (its own head, if it has one); "": the shared head


class LengthPrediction(Message):
    bucket: int  # index into llmesh.wire.lengths buckets
    label: str  # e.g. "[64,128)"
    expected_tokens: float  # the median length estimate (its order across requests is the model's ranking)
    confidence: float  # probability of `bucket` (0 when not `informative`)
    truncated: bool  # the model read only the prompt's first MAX_PROMPT_CHARS characters (and its length)
    model_version: str
    replica: str  # the predictor replica that answered; LengthObserved goes back to it
    # False: on the deployment's own lengths the model did not beat a constant; policies act as without it
    informative: bool = True


class LengthRemainingRequest(Message):
    """How many more tokens a running request will generate, from its prompt and its output so far
    (a decode worker asks every `MESH_LENGTH_REFINE_EVERY` tokens, off the engine's path)."""

    request_id: str = ""
    prompt: str  # cut as LengthPredictRequest's
    generated: str  # the output so far (its last MAX_GENERATED_CHARS characters, when longer)
    generated_chars: int | None = Field(default=None, ge=0)  # the whole output's length, if `generated` is cut
    generated_tokens: int = Field(ge=0)  # the whole output's length in the serving model's tokens
    model: str = ""  # the served model generating it, as LengthPredictRequest's


class LengthRemaining(Message):
    remaining_tokens: float  # in the serving model's tokens
    generated_tokens: int
    informative: bool
    model_version: str
    replica: str


class LengthObserved(Message):
    """A worker's report when a request carrying a prediction finishes."""

    request_id: str
    predicted: LengthPrediction
    actual_tokens: int  # completion tokens, the first (from prefill) included
    finish_reason: str  # "length": the cap cut it, so the natural length is at least actual_tokens
    model: str = ""  # the served model that answered: the sample refits its head ("": the prediction's model)


class LengthStatsRequest(Message):
    pass


class LengthBucketStats(Message):
    bucket: int
    label: str
    observed: int  # finished naturally ("stop") with this bucket predicted
    exact: int  # ... whose actual length fell in it
    within_one: int  # ... or in a neighbouring bucket
    abs_error_tokens: float  # sum of |expected_tokens - actual_tokens|


class LengthStats(Message):
    """Prediction against actual, per predicted bucket, since the replica started."""

    replica: str
    model_version: str
    predictions: int
    censored: int  # observations cut by max_tokens: not scored, not used to refit
    samples: int  # (prompt, actual length) pairs available to a refit, every model's
    buckets: list[LengthBucketStats]
    heads: dict[str, str] = {}  # served model -> the version of its own head (others use the shared one)


class LengthRefit(Message):
    """Refit a head (the calibration of the model's score to lengths) on recent (prompt, actual
    length) pairs; keep the current one unless the refit has a lower log loss on the held-out part
    (split by prompt). `model` "": the shared head, on every model's pairs; else that served
    model's own head, on its pairs."""

    min_samples: int = Field(default=50, ge=2)
    holdout_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    model: str = ""


class LengthRefitResult(Message):
    accepted: bool
    reason: str
    samples: int
    held_out: int
    before: dict[str, float]  # held-out log_loss, exact, within_one, mae_tokens, constant_mae_tokens: current head
    after: dict[str, float]  # ... of the refit
    model_version: str  # the version serving `model` now
    model: str = ""  # the head refitted ("": the shared one)


class LengthHead(Message):
    """An accepted refit, published to every replica; the head itself is the blob."""

    base_version: str  # the artifact it was fitted on (its encoder): others ignore it
    version: str
    model: str = ""  # the served model whose head it is ("": the shared head)


# ---- request path ---------------------------------------------------------------------


class ChatMessage(Message):
    role: str
    content: str
    # an assistant turn's tool calls, each {"id", "type": "function", "function": {"name", "arguments"}} with its
    # arguments a JSON object (as chat templates take them, not OpenAI's string)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # a tool turn's: the call it answers
    name: str | None = None
    reasoning: str | None = None  # an assistant turn's (the template gets it as `reasoning_content` too, as vLLM's)


class ReasoningGate(Message):
    """Where a chat's structured output starts on a model with a reasoning parser, whose engines hold the
    constraint until the reasoning ends (vLLM's `reasoning_ended` and `reasoning_parser_kwargs`)."""

    from_start: bool = False  # the grammar reads the whole output (vLLM: include_reasoning false, a parser's grammar)
    chat_template_kwargs: dict[str, Any] = {}  # the template's variables, which some parsers read (enable_thinking)


class RepetitionDetection(Message):
    """vLLM's `repetition_detection`: the output ends ("repetition") once its last `min_pattern_size` to
    `max_pattern_size` tokens repeat `min_count` times in a row, with vLLM's checks."""

    max_pattern_size: int = Field(default=0, ge=0, le=2**31)
    min_pattern_size: int = Field(default=0, ge=0, le=2**31)
    min_count: int = Field(default=0, ge=0, le=2**31)

    @model_validator(mode="after")
    def _checked(self) -> RepetitionDetection:
        if self.min_pattern_size > self.max_pattern_size:  # (vLLM's words)
            raise ValueError(
                "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= max_pattern_size. "
                "Set both to 0 to disable repetitive pattern detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                "min_count must be >= 2 to detect repetitive patterns in engine output. If you do not wish to "
                "detect repetitive patterns, set max_pattern_size to 0."
            )
        return self

    def ends(self, token_ids: Sequence[int]) -> bool:
        """Whether the output `token_ids` ends in such a repetition (vLLM's check_sequence_repetition)."""
        count, smallest = self.min_count, max(self.min_pattern_size, 1)
        if self.max_pattern_size <= 0 or count < 2:
            return False
        for size in range(smallest, self.max_pattern_size + 1):
            if size * count > len(token_ids):
                return False
            tail = token_ids[len(token_ids) - size :]
            if all(
                token_ids[len(token_ids) - size * (m + 1) : len(token_ids) - size * m] == tail for m in range(1, count)
            ):
                return True
        return False


class SamplingOptions(Message):
    max_tokens: int | None = Field(default=None, ge=1)  # None: the rest of the context
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = []
    seed: int | None = None
    ignore_eos: bool = False  # generate up to max_tokens even past the end-of-sequence token
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on the prompt's tokens and the output's alike, so exact across engines
    frequency_penalty: float = 0.0  # OpenAI's, on the whole output (an engine that resumes it counts its prompt's end)
    presence_penalty: float = 0.0
    min_tokens: int = 0  # of the whole output (an engine that resumes it owes only the rest)
    logit_bias: dict[str, float] = {}  # token id (MessagePack maps keep string keys) -> added to its logit
    stop_token_ids: list[int] = []  # end the output (their text not shown), as the end-of-sequence token does
    include_stop_str_in_output: bool = False  # the text of the stop string or token that ended the output shown
    logprobs: int | None = None  # how many of the likeliest tokens each step comes with; None: no logprobs
    # instead of the likeliest, these tokens' logprobs with each step's (vLLM's logprob_token_ids; with logprobs)
    logprob_token_ids: list[int] | None = None
    # the first delta carries the prompt: its text and, with logprobs, its logprobs (the engine that computes the
    # prompt computes them: a resumed engine does not)
    echo: bool = False
    # vLLM's prompt_logprobs: each prompt token's logprob and rank with this many of the likeliest (the engine that
    # computes the prompt computes them; an echo's logprobs, if any, come from the same)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    prompt_text: bool = False  # a chat's first delta carries its rendered template (vLLM's return_prompt_text)
    # a structured output: vLLM's StructuredOutputsParams fields (one constraint: json, regex, choice, grammar or
    # json_object); each engine's grammar follows the whole output (an engine that resumes it starts past its start)
    structured: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None  # the only tokens that may be sampled (vLLM's)
    skip_special_tokens: bool = True  # special tokens show no text (vLLM's default)
    spaces_between_special_tokens: bool = True  # false (with special tokens shown): none between two added tokens
    bad_words: list[str] = []  # vLLM's: never generated (a word's last token is banned after the rest of it)
    # a chat's structured output on a model with a reasoning parser (None: the engine's parser reads the prompt,
    # as vLLM's for a completion)
    reasoning: ReasoningGate | None = None
    # vLLM's: the reasoning's end forced after this many reasoning tokens (None: no budget); an engine that resumes
    # the output counts those of its prompt's end, as vLLM's counts a prompt's open reasoning
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # the whole output's repetition ends it: each engine checks its own output, and the router the whole
    # (a pattern across the hand-over is seen by no engine)
    repetition_detection: RepetitionDetection | None = None

    @property
    def prompt_logprob_count(self) -> int | None:
        """How many of the likeliest tokens each prompt step's logprobs come with (None: no prompt logprobs), as
        vLLM's servers ask their engine: `prompt_logprobs`, else an echo's `logprobs`."""
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None


class LoraAdapter(Message):
    """A LoRA adapter a request runs with: its name (what clients send in `model`) and its folder, which an
    engine that has not loaded it yet loads it from (and whose contents its KV keys carry:
    llmesh.wire.kvkeys.chain_seed)."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)


class LoraCommand(Message):
    """Router to a worker (`Subjects.lora`): load an adapter into its engine and serve it from now on, or
    unload it (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter). Answered with `Ack`, or the
    error that refused it (an adapter vLLM cannot load: its rank past max_lora_rank, a folder without one)."""

    op: Literal["load", "unload"]
    adapter: LoraAdapter


class PrefillRequest(Message):
    request_id: str
    model: str
    prompt: str | None = None  # completions, as text
    prompt_token_ids: list[int] | None = None  # completions, as token ids
    messages: list[ChatMessage] | None = None  # chat; the worker applies the chat template
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI's tools, for the chat template
    # chat: the template's other variables (add_generation_prompt, continue_final_message, documents, a request's
    # chat_template_kwargs), as vLLM's server merges them
    template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # the tokenizer's (its BOS); None: vLLM's default, chat no, text yes
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: as many as the context allows)
    truncation_side: Literal["left", "right"] | None = None  # the end truncation cuts (None: the tokenizer's)
    sampling: SamplingOptions  # the first token is sampled here, as a monolithic engine would
    deadline: float  # unix time
    predicted_length: LengthPrediction | None = None
    cache_salt: str | None = None  # KV prefixes are shared only between requests with the same salt
    priority: int = 0  # vLLM's convention: lower is more urgent
    lora: LoraAdapter | None = None  # the adapter it runs with (KV is shared only within an adapter)


class TokenizePrompt(Message):
    """A prompt in one of `PrefillRequest`'s forms, rendered and tokenized as its generation would be
    (the router's /tokenize)."""

    model: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    token_strs: bool = False  # each token's string too (the tokenizer's, not its text)


class Tokenized(Message):
    tokens: list[int]
    token_strs: list[str] | None = None
    max_model_len: int


class DetokenizeTokens(Message):
    """Token ids to text, as the tokenizer decodes them (the router's /detokenize)."""

    model: str
    tokens: list[int]


class Detokenized(Message):
    text: str


# per token: the sampled token (a prompt's own token), then the likeliest, each (token id, logprob, text), as
# vLLM's engine gives them (the sampled one once, also where it is among the likeliest); a logprob of None: none
# (a prompt's first token)
LogprobSteps = list[list[tuple[int, float | None, str]]]


class TokenDelta(Message):
    """One step of generated output; the last one carries finish_reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # with finish_reason "stop", vLLM's: the stop string or stop token id that ended it (None: end of sequence)
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_token_ids: list[int] | None = None  # a whole request's first delta: its prompt as the worker tokenized it
    # a request's first delta: its prompt's tokens whose KV was found, not computed (prefix cache or kv-store)
    cached_tokens: int | None = None
    logprobs: LogprobSteps | None = None  # with SamplingOptions.logprobs
    # the first delta's, with SamplingOptions.echo: as given, else decoded; with SamplingOptions.prompt_text, a chat's
    # rendered template
    prompt_text: str | None = None
    # the first delta's, with SamplingOptions.prompt_logprobs or with echo and logprobs; and the rank of each step's
    # first entry, the prompt's token (the others are the likeliest, in order, from rank 1 on, that one left out)
    prompt_logprobs: LogprobSteps | None = None
    prompt_ranks: list[int | None] | None = None
    # a delta of several tokens whose text its worker made: the length of its text after each token, so that the
    # router can end the output inside it, as an engine ends it at a token (llmesh_router.stops); None: at its end
    text_ends: list[int] | None = None

    def continued_by(self, later: TokenDelta) -> bool:
        """Whether `later`, the next delta of this one's stream, may join it in one chunk (as a client behind its
        stream is sent several tokens at once): not after the stream's end, not a delta with a stream's opening
        fields, not where only one of them has logprobs."""
        opening = (later.prompt_token_ids, later.cached_tokens, later.prompt_text, later.prompt_logprobs)
        return (
            self.finish_reason is None
            and opening == (None, None, None, None)
            and (self.logprobs is None) == (later.logprobs is None)
        )

    @staticmethod
    def joined(run: Sequence[TokenDelta]) -> TokenDelta:
        """One delta of `run`, each continued by the next (`continued_by`): their text, tokens and logprobs in
        order, the last one's counts and end."""
        last = run[-1]
        if len(run) == 1:
            return last
        return last.model_copy(
            update={
                "text": "".join(d.text for d in run),
                "token_ids": [t for d in run for t in d.token_ids],
                "logprobs": None if last.logprobs is None else [step for d in run for step in d.logprobs or ()],
                "text_ends": None,
            }
        )


class KvHandle(Message):
    """Where a request's KV lies in the kv-store: what another worker needs to load it.

    `block_hashes` chain the stored blocks in order (`llmesh.wire.kvkeys.block_hashes`); the last may be
    partial. A `tail_hash` names an exported last block instead (`llmesh.wire.kvkeys.tail_hash`): it holds at
    least the tokens past the full blocks, up to `num_tokens`, and is loaded without re-hashing.
    """

    fingerprint: str
    block_size: int = Field(ge=1)
    block_hashes: list[str]
    num_tokens: int = Field(ge=0)  # tokens whose KV the blocks hold
    tail_hash: str | None = None
    kv_layout: dict[str, Any] | None = None  # the writer's, to name what differs on a fingerprint mismatch
    pinned_until: float = 0.0  # unix time until which the store keeps the blocks (0: not pinned)

    def params(self) -> dict[str, Any]:
        """The handle as the engine's `kv_transfer_params` (what llmesh.engine.kv_connector reads)."""
        return self.model_dump(exclude_none=True)


class PrefillResult(Message):
    """The prompt's KV is in the kv-store; `first` is the first generated token.

    If `first.finish_reason` is set the request is complete and needs no decode.
    """

    prompt_token_ids: list[int]
    max_tokens: int  # resolved against the context
    first: TokenDelta
    kv: KvHandle | None = None  # None: nothing stored (the request ended at its first token)
    fingerprint: str


class DecodeRequest(Message):
    """Continue a request after the tokens it generated so far, on any decode worker.

    The engine computes only the last of `output_token_ids` (with the KV of everything before it from
    the store, `kv`, or looked up there when `kv` is None; what is missing is recomputed), exactly
    like a monolithic engine's next decode step. This is the first decode after a prefill (one
    output token), a live migration's hand-over and a failover alike.
    """

    request_id: str
    model: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = Field(min_length=1)  # generated so far, streamed to the client already
    sampling: SamplingOptions  # max_tokens counts every output token, those already generated too
    kv: KvHandle | None = None
    fingerprint: str  # the KV layout the request's KV was computed in; decode refuses a mismatch
    deadline: float
    predicted_length: LengthPrediction | None = None
    cache_salt: str | None = None  # the prefill's: decode re-derives the same block hashes
    priority: int = 0
    migration_id: str | None = None  # the migration this resume completes (its target holds a slot for it)
    recompute: bool = False  # compute the whole context again instead of loading KV (the baseline migration)
    lora: LoraAdapter | None = None  # the prefill's


class AbortRequest(Message):
    request_id: str


# ---- hosts and the models they serve --------------------------------------------------


class ModelTraffic(Message):
    """A router's requests by model, published every second on `Subjects.TRAFFIC`: `arrivals` counts
    every request since the router started (placement takes rates from the differences), `parked` those
    waiting now because no active worker serves their model."""

    router_id: str
    arrivals: dict[str, int] = Field(default_factory=dict)
    parked: dict[str, int] = Field(default_factory=dict)


class HostedWorker(Message):
    worker_id: str
    model: str
    role: Role
    kv_cache_bytes: int = 0  # the KV space placement gave it (0: the worker's own setting)


class HostInfo(Message):
    """A host agent's heartbeat (`Subjects.HOST_HEARTBEAT`): the pre-started processes it holds ready by
    role, the workers it started (running or starting), and the memory the models on it may use."""

    host_id: str
    heartbeat_s: float
    standbys: dict[str, int] = Field(default_factory=dict)  # role -> ready
    workers: list[HostedWorker] = Field(default_factory=list)
    memory_bytes: int = 0


class ActivateCommand(Message):
    """To a host agent (`Subjects.activate`): make a ready standby of `role` the worker `worker_id` serving
    the catalogue's `model` (llmesh.engine.standby), with `kv_cache_bytes` of KV space (placement's share of
    the host's memory: `MESH_KV_CACHE_BYTES`; 0: the worker's own setting)."""

    command_id: str
    model: str
    role: Role
    worker_id: str
    reason: str = ""
    kv_cache_bytes: int = Field(0, ge=0)


class ModelPlacement(Message):
    """A model as placement sees it (in `PlacementStatus`)."""

    name: str
    rate: float  # requests/s over the routers, smoothed
    parked: int  # requests waiting for a worker of it
    idle_s: float  # since its last request (inf: none yet)
    hosts: list[str] = Field(default_factory=list)  # where its active workers run


class ActivateOutcome(Message):
    command_id: str
    host_id: str
    worker_id: str
    accepted: bool
    reason: str = ""


# ---- live migration, drain ------------------------------------------------------------------


class MigrateCommand(Message):
    """To a decode worker (`Subjects.migrate`): move a running request to `target`. Idempotent by id."""

    migration_id: str
    request_id: str
    target: str
    reason: str = "manual"  # what decided it (a placement policy, an operator, a drain)
    recompute: bool = False  # the target recomputes the context instead of loading it (for comparison)


class MigrateOutcome(Message):
    """The source's answer: `accepted` once the target holds a slot and the source stopped the request
    (its stream then ends with `Migrated`); refused with the reason otherwise (the request goes on)."""

    migration_id: str
    request_id: str
    source: str
    target: str
    accepted: bool
    reason: str = ""


class MigratePrepare(Message):
    """Source to target (`Subjects.migrate_in`): hold a slot for the request and fetch its stored KV
    into the engine now, while the source keeps decoding. Answered with `Ack`, or an error if refused."""

    migration_id: str
    request_id: str
    model: str
    fingerprint: str
    token_ids: list[int]  # prompt and output so far
    max_tokens_left: int = Field(ge=1)
    cache_salt: str | None = None
    hold_s: float = Field(default=10.0, gt=0)  # the slot is given up if the hand-over does not come
    prefetch: bool = True  # load the stored blocks into the engine now (not for a `recompute` migration)
    lora: LoraAdapter | None = None  # the request's (its KV keys, and the prefetch runs with it)


class DurableTail(Message):
    """A decode worker to its engine's connector (`Subjects.kv_control`): from the next step on, write
    the partial last block of the request named by its `tail_id` every step, so that a migration's
    hand-over finds it stored (Ack; an error if no such request is running there)."""

    tail_id: str
    on: bool = True  # False: back to writing only full blocks (the migration was called off)


class Migrated(Message):
    """The last message of a decode stream whose request moved: go on with `output_tokens` outputs
    (all the stream carried) on `target`, loading `kv`."""

    migration_id: str
    target: str
    kv: KvHandle | None  # None: recompute (a `recompute` migration)
    output_tokens: int


class PlacementRequest(Message):
    """An operator's command to the active placement service (`Subjects.PLACEMENT`), answered with
    `PlacementStatus`: `status` only reports; `drain` empties `worker_id` (and lets it exit);
    `migrate` moves `request_id` to `target` (or to the policy's choice when None); `role` has
    `worker_id`, built with both roles, serve `role`."""

    op: Literal["status", "drain", "migrate", "role"]
    worker_id: str | None = None
    request_id: str | None = None
    target: str | None = None
    role: Role | None = None


class PlacementStatus(Message):
    leader: str  # the placement service answering (the lease holder)
    workers: list[WorkerInfo]
    decisions: dict[str, int] = Field(default_factory=dict)  # commands issued since it started, by kind/outcome
    scaling: int = 0  # Llumnix's freeness band: +1 add a decode instance, -1 one can go, 0 hold
    message: str = ""
    hosts: list[HostInfo] = Field(default_factory=list)
    models: list[ModelPlacement] = Field(default_factory=list)
    events: list[PlacementDecision] = Field(default_factory=list)  # its latest model decisions, oldest first


class DrainCommand(Message):
    """To a worker (`Subjects.drain`): take no new requests; exit once the last one has left (if `exit`)."""

    exit: bool = True


class RoleCommand(Message):
    """To a worker built with both roles (`Subjects.role`): serve `role` from now on (BanaServe's
    adaptive module migration). Its prompts in flight finish there; its decodes, once it serves prefill, the
    placement service migrates to the decode pool. Idempotent by id."""

    command_id: str
    role: Role
    reason: str = "manual"


class RoleOutcome(Message):
    command_id: str
    worker_id: str
    role: Role  # the role it serves now
    accepted: bool
    reason: str = ""


class PlacementDecision(Message):
    """Published on `Subjects.PLACEMENT_EVENTS` for every command the placement service issues."""

    kind: Literal["migrate", "drain", "role", "scale", "activate", "evict"]
    reason: str
    detail: dict[str, Any] = Field(default_factory=dict)


# ---- kv-store ---------------------------------------------------------------------------


class KvShardInfo(Message):
    """A kv-store shard's announcement, published every `heartbeat_s` on `Subjects.KV_SHARDS`
    and at once when a client asks on `Subjects.KV_DISCOVER`: where its data plane listens."""

    shard: str
    data_host: str
    data_port: int
    heartbeat_s: float
    token: str = ""  # what a data-plane connection shows first (short-lived; only workers may read this subject)


class KvDiscover(Message):
    """Ask every shard to announce itself now."""


class KvStatsRequest(Message):
    pass


class KvFlush(Message):
    """Spill every chunk in memory to the SSD tier and free the memory (before maintenance);
    answered with the shard's KvStats. Chunks the SSD tier cannot take stay in memory."""


class KvStats(Message):
    """A shard's counters; `chunks`, `bytes` and `capacity_bytes` are the memory tier's."""

    chunks: int
    bytes: int
    capacity_bytes: int
    pinned_bytes: int
    hits: int  # all tiers
    misses: int
    evictions: int  # dropped for good (no SSD tier, or it refused)
    puts: int
    memory_hits: int = 0
    ssd_hits: int = 0
    demotions: int = 0  # memory -> SSD
    promotions: int = 0  # SSD -> memory
    ssd_enabled: bool = False
    ssd_chunks: int = 0
    ssd_bytes: int = 0
    ssd_capacity_bytes: int = 0
    ssd_corrupt: int = 0  # unreadable files dropped on read
    bytes_put: int = 0  # received by puts, all time
    bytes_got: int = 0  # sent by gets, all time


# ---- codec ---------------------------------------------------------------------------------


def encode(msg: Message, blob: bytes | bytearray | memoryview = b"") -> bytes:
    """A frame of `msg` (its fields at their defaults left out: the receiver's model fills them, and a token's
    delta is 82 bytes instead of 197) and `blob`."""
    try:
        header = msgpack.packb(
            {"v": SCHEMA_VERSION, "t": type(msg).__name__, "d": msg.model_dump(mode="python", exclude_defaults=True)},
            use_bin_type=True,
        )
    except UnicodeEncodeError as exc:  # a lone surrogate: not representable in UTF-8
        raise BadMessage(f"{type(msg).__name__} holds text that is not valid Unicode: {exc.reason}") from None
    except OverflowError:  # MessagePack's integers are 64-bit
        raise BadMessage(f"{type(msg).__name__} holds an integer beyond 64 bits") from None
    return b"".join((len(header).to_bytes(_HEADER_LEN, "big"), header, blob))


def decode_any(data: bytes | memoryview) -> tuple[Message, memoryview]:
    """Decode a frame; an `ErrorReply` is raised as its MeshError."""
    view = memoryview(data)
    if len(view) < _HEADER_LEN:
        raise BadMessage(f"frame of {len(view)} bytes is shorter than its header")
    n = int.from_bytes(view[:_HEADER_LEN], "big")
    if _HEADER_LEN + n > len(view):
        raise BadMessage(f"frame header claims {n} bytes but only {len(view) - _HEADER_LEN} follow")
    try:
        head = msgpack.unpackb(view[_HEADER_LEN : _HEADER_LEN + n], raw=False)
        version, type_name, fields = head["v"], head["t"], head["d"]
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadMessage(f"undecodable message header: {exc}") from None
    if version != SCHEMA_VERSION:
        raise BadMessage(f"schema version {version} is not supported (this build speaks {SCHEMA_VERSION})")
    cls = _TYPES.get(type_name)
    if cls is None:
        raise BadMessage(f"unknown message type {type_name!r}")
    try:
        msg = cls.model_validate(fields)
    except ValidationError as exc:
        raise BadMessage(f"invalid {type_name}: {exc.errors(include_url=False)}") from None
    if isinstance(msg, ErrorReply):
        raise from_code(msg.code, msg.message, msg.param)
    return msg, view[_HEADER_LEN + n :]


def split_batch(data: bytes | memoryview) -> list[tuple[str, memoryview]]:
    """The (stream id, frame) pairs of a StreamBatch."""
    batch, blob = decode(data, StreamBatch)
    if len(batch.sizes) != len(batch.streams) or sum(batch.sizes) != len(blob) or min(batch.sizes, default=0) < 0:
        raise BadMessage(f"a StreamBatch of {len(blob)} bytes does not hold frames of {batch.sizes}")
    out, start = [], 0
    for stream_id, size in zip(batch.streams, batch.sizes):
        out.append((stream_id, blob[start : start + size]))
        start += size
    return out


def decode(data: bytes | memoryview, expected: type[M]) -> tuple[M, memoryview]:
    msg, blob = decode_any(data)
    if not isinstance(msg, expected):
        raise BadMessage(f"expected {expected.__name__}, got {type(msg).__name__}")
    return msg, blob


class Subjects:
    """NATS subjects; every service builds its names here, never by hand."""

    PREFIX: ClassVar[str] = "mesh"
    HEARTBEAT: ClassVar[str] = "mesh.heartbeat"
    KV_SHARDS: ClassVar[str] = "mesh.kv.shards"
    KV_DISCOVER: ClassVar[str] = "mesh.kv.discover"
    LENGTH_PREDICT: ClassVar[str] = "mesh.length.predict"  # queue group: one replica answers
    LENGTH_REMAINING: ClassVar[str] = "mesh.length.remaining"  # queue group: decode workers' refinements
    LENGTH_REFIT: ClassVar[str] = "mesh.length.refit"  # queue group
    LENGTH_HEAD: ClassVar[str] = "mesh.length.head"  # an accepted refit, to every replica
    PLACEMENT: ClassVar[str] = "mesh.placement"  # operator commands to the active placement service
    PLACEMENT_EVENTS: ClassVar[str] = "mesh.placement.events"  # its decisions and scaling advice
    TRAFFIC: ClassVar[str] = "mesh.traffic"  # routers' requests by model (`ModelTraffic`)
    HOST_HEARTBEAT: ClassVar[str] = "mesh.host.heartbeat"  # host agents' `HostInfo`

    @staticmethod
    def length_observed(replica: str) -> str:
        return f"mesh.length.observed.{replica}"

    @staticmethod
    def length_stats(replica: str) -> str:
        return f"mesh.length.stats.{replica}"

    @staticmethod
    def worker(role: str, worker_id: str) -> str:
        return f"mesh.{role}.{worker_id}"

    @staticmethod
    def generate(worker_id: str) -> str:
        """A whole request on one engine, prefill included (a decode worker, when prefill is backed up)."""
        return f"mesh.generate.{worker_id}"

    @staticmethod
    def tokenizer(worker_id: str) -> str:
        """A worker's tokenizer and chat template: `TokenizePrompt` and `DetokenizeTokens`."""
        return f"mesh.tokenizer.{worker_id}"

    @staticmethod
    def abort(worker_id: str) -> str:
        return f"mesh.abort.{worker_id}"

    @staticmethod
    def migrate(worker_id: str) -> str:
        """Commands to a decode worker: move one of its requests elsewhere."""
        return f"mesh.migrate.{worker_id}"

    @staticmethod
    def migrate_in(worker_id: str) -> str:
        """A source worker's hand-shake with a migration's target."""
        return f"mesh.migrate_in.{worker_id}"

    @staticmethod
    def kv_control(worker_id: str) -> str:
        """A worker to its own engine's KV connector (the scheduler's side, in the engine's process)."""
        return f"mesh.kvctl.{worker_id}"

    @staticmethod
    def activate(host_id: str) -> str:
        """Commands to a host agent: start a worker of a model from a pre-started process."""
        return f"mesh.host.activate.{host_id}"

    @staticmethod
    def drain(worker_id: str) -> str:
        return f"mesh.drain.{worker_id}"

    @staticmethod
    def lora(worker_id: str) -> str:
        """Commands to a worker: load or unload a LoRA adapter (`LoraCommand`)."""
        return f"mesh.lora.{worker_id}"

    @staticmethod
    def role(worker_id: str) -> str:
        """Commands to a worker built with both roles: which one to serve (`RoleCommand`)."""
        return f"mesh.role.{worker_id}"

    @staticmethod
    def kv(shard: str, op: str) -> str:
        return f"mesh.kv.{shard}.{op}"
