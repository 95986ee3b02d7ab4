"""One error tree for the whole mesh.

Every error has a wire `code` (carried in `ErrorReply` over NATS) and an HTTP status
(used by the router), so a failure raised in a worker reaches the client typed.
"""

from __future__ import annotations

import asyncio


class MeshError(Exception):
    """Base of every error the mesh raises on purpose."""

    code = "internal_error"
    http_status = 500
    error_type = "server_error"  # OpenAI `error.type`

    def __init__(self, message: str = "", *, param: str | None = None):
        super().__init__(message or self.__doc__ or self.code)
        self.message = message or (self.__doc__ or self.code)
        self.param = param


class InvalidRequest(MeshError):
    """The request is malformed or asks for something impossible."""

    code = "invalid_request"
    http_status = 400
    error_type = "invalid_request_error"


class RequestTooLarge(InvalidRequest):
    """The request does not fit in a message to a worker (NATS's max_payload)."""

    code = "request_too_large"
    http_status = 413


class Unauthenticated(MeshError):
    """The request carries no valid credential."""

    code = "unauthenticated"
    http_status = 401
    error_type = "invalid_request_error"


class Forbidden(MeshError):
    """The credential is valid but not for this (an admin endpoint asked with a client's key)."""

    code = "forbidden"
    http_status = 403
    error_type = "invalid_request_error"


class MissingApiKey(Unauthenticated):
    """No API key was sent."""

    code = "missing_api_key"


class InvalidApiKey(Unauthenticated):
    """The API key sent is not one the router accepts (OpenAI's code)."""

    code = "invalid_api_key"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus max_tokens does not fit the model's context."""

    code = "context_length_exceeded"


class ModelNotFound(MeshError):
    """No worker serves the requested model."""

    code = "model_not_found"
    http_status = 404
    error_type = "invalid_request_error"


class ResponseNotFound(MeshError):
    """No stored response has this id (none was stored, it expired, or another API key stored it)."""

    code = "response_not_found"
    http_status = 404
    error_type = "invalid_request_error"


class ServiceUnavailable(MeshError):
    """No live worker can take the request right now."""

    code = "service_unavailable"
    http_status = 503


class NoResponders(ServiceUnavailable):
    """Nothing subscribes to the subject (NATS has no responders): the worker or service is gone, and
    the message reached no one."""

    code = "no_responders"


class AtCapacity(ServiceUnavailable):
    """Every worker that fits the request is full, or over the dispatch policy's threshold: it may
    wait for room (the router's queue)."""

    code = "at_capacity"


class ModelNotPlaced(AtCapacity):
    """The mesh has the model, but no active worker serves it now (not placed yet, evicted, restarting):
    the request waits for one."""

    code = "model_not_placed"


class Overloaded(MeshError):
    """The router's queue is full, or cannot serve the request before its deadline: retry later.
    OpenAI's rate-limit shape, so clients back off by `Retry-After`."""

    code = "rate_limit_exceeded"
    http_status = 429
    error_type = "requests"

    def __init__(self, message: str = "", *, param: str | None = None, retry_after_s: float = 1.0):
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class WorkerLost(MeshError):
    """The worker handling the request stopped answering."""

    code = "worker_lost"
    http_status = 502


class StreamInterrupted(WorkerLost):
    """The bus reconnected while the request was in flight: what the worker sent meanwhile may be lost
    (NATS delivers at most once), so the request is sent again from what arrived."""

    code = "stream_interrupted"


class Timeout(MeshError, asyncio.TimeoutError):
    """The request's deadline passed."""

    code = "timeout"
    http_status = 504


class KVFingerprintMismatch(MeshError):
    """Prefill and decode disagree on model, dtype, block size or KV layout."""

    code = "kv_fingerprint_mismatch"
    http_status = 500


class KVStoreFull(MeshError):
    """The kv-store cannot make room: everything left is pinned."""

    code = "kv_store_full"
    http_status = 507


class BadMessage(MeshError):
    """A bus message could not be decoded."""

    code = "bad_message"
    http_status = 400


_BY_CODE: dict[str, type[MeshError]] = {}


def _register(cls: type[MeshError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(MeshError)


def from_code(code: str, message: str, param: str | None = None) -> MeshError:
    """Rebuild a typed error received over the wire; unknown codes become MeshError."""
    return _BY_CODE.get(code, MeshError)(message, param=param)
