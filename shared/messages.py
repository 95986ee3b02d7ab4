"""Every message that crosses the bus, and the one codec that frames them.

Frame: 4-byte big-endian length of a MessagePack header, the header
`{"v": SCHEMA_VERSION, "t": type name, "d": fields}`, then an optional raw blob
(KV bytes travel there, never inside MessagePack, so they are not copied twice).
Types are pydantic models: a malformed or mistyped message fails to decode with
`BadMessage`, never with a crash deeper down.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmesh.errors import BadMessage, MeshError, from_code

SCHEMA_VERSION = 1
_HEADER_LEN = 4

_TYPES: dict[str, type[Message]] = {}


class Message(BaseModel):
    """Base of every bus message; subclasses register themselves by class name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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


# ---- discovery and load ------------------------------------------------------------


class WorkerInfo(Message):
    """Heartbeat a worker publishes every `heartbeat_s` on `subjects.HEARTBEAT`."""

    worker_id: str
    role: Literal["prefill", "decode"]
    model: str
    fingerprint: str  # KV layout identity; prefill and decode must match
    max_model_len: int
    running: int  # requests in the engine
    queued_tokens: int  # prompt tokens (prefill) or remaining output budget (decode) in flight
    capacity: int  # requests it accepts concurrently
    heartbeat_s: float


# ---- request path ---------------------------------------------------------------------


class ChatMessage(Message):
    role: str
    content: str


class SamplingOptions(Message):
    max_tokens: int | None = Field(default=None, ge=1)  # None: the rest of the context
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = []
    seed: int | None = None


class PrefillRequest(Message):
    request_id: str
    model: str
    prompt: str | None = None  # completions, as text
    prompt_token_ids: list[int] | None = None  # completions, as token ids
    messages: list[ChatMessage] | None = None  # chat; the worker applies the chat template
    sampling: SamplingOptions  # the first token is sampled here, as a monolithic engine would
    deadline: float  # unix time


class TokenDelta(Message):
    """One step of generated output; the last one carries finish_reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class PrefillResult(Message):
    """The prompt's KV is in the kv-store; `first` is the first generated token.

    If `first.finish_reason` is set the request is complete and needs no decode.
    """

    prompt_token_ids: list[int]
    max_tokens: int  # resolved against the context
    first: TokenDelta
    kv_transfer_params: dict[str, Any]
    fingerprint: str


class DecodeRequest(Message):
    """Continue after the prefill's first token: the KV of `prompt_token_ids` comes from the store
    and the engine computes only `first_token`, exactly like a monolithic engine's first decode step."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    first_token: int
    sampling: SamplingOptions  # max_tokens counts the first token too
    kv_transfer_params: dict[str, Any] | None = None
    fingerprint: str  # the prefill worker's; decode refuses a mismatch
    deadline: float


class AbortRequest(Message):
    request_id: str


# ---- kv-store ---------------------------------------------------------------------------


class KvShardInfo(Message):
    """A kv-store shard's announcement, published every `heartbeat_s` on `Subjects.KV_SHARDS`
    and at once when a client asks on `Subjects.KV_DISCOVER`: where its data plane listens."""

    shard: str
    data_host: str
    data_port: int
    heartbeat_s: float


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
    header = msgpack.packb(
        {"v": SCHEMA_VERSION, "t": type(msg).__name__, "d": msg.model_dump(mode="python")},
        use_bin_type=True,
    )
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

    @staticmethod
    def worker(role: str, worker_id: str) -> str:
        return f"mesh.{role}.{worker_id}"

    @staticmethod
    def abort(worker_id: str) -> str:
        return f"mesh.abort.{worker_id}"

    @staticmethod
    def kv(shard: str, op: str) -> str:
        return f"mesh.kv.{shard}.{op}"
