from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from llmesh.policies import POLICIES, QUEUE_POLICIES, Policy, QueuePolicy, make_policy, make_queue_policy
from llmesh.wire.config import CommonSettings, ModelSettings
from llmesh.wire.secrets import ADMIN_KEYS_FILE, API_KEYS_FILE

from .auth import KeyRing


class RouterSettings(ModelSettings, CommonSettings):
    NATS_USER: ClassVar[str] = "router"
    REDIS_URLS: ClassVar[tuple[str, ...]] = ("redis_url", "responses_redis_url")
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    api_keys: str = Field(
        "",
        description="API keys the OpenAI endpoints accept (`Authorization: Bearer`), "
        "comma-separated: each a key or its `sha256:` digest, optionally followed by a name and a "
        "rate in requests per minute. Empty, with no key file: the API is open.",
    )
    api_keys_file: Path | None = Field(
        None,
        description="A file of API key digests, one per line: `sha256:<hex> "
        "<name> [<requests per minute>]` (`python -m llmesh_router.auth new NAME "
        "--file F` makes a key and adds its line). Default: MESH_SECRETS_DIR's, if set.",
    )
    admin_api_keys: str = Field(
        "",
        description="Keys of the admin endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter), as MESH_API_KEYS "
        "gives the API's; no client key opens them. Empty, with no admin key file: they are closed (403).",
    )
    admin_api_keys_file: Path | None = Field(
        None,
        description="A file of admin key digests, as MESH_API_KEYS_FILE's. Default: MESH_SECRETS_DIR's "
        "(`admin-api-keys`; the key itself in `admin-api-key`), if set.",
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Deadline of every request, from arrival.")
    shutdown_grace_s: int = Field(
        30,
        ge=1,
        description="A stopping router (SIGTERM) takes no new connections and lets the requests it is answering "
        "finish for this long before it cuts them (compose's `stop_grace_period` must be longer).",
    )
    max_request_bytes: int = Field(
        16 * 2**20,
        ge=1024,
        description="The largest request body the router reads; a larger one is a 413 before it is read whole. "
        "(A request's message to a worker must also fit in NATS's max_payload, 8 MB under `make run`.)",
    )
    responses_redis_url: str = Field(
        "",
        description="Where the Responses API keeps its stored responses: a Redis that persists them (compose's "
        "`redis-responses`, an append-only file); empty: MESH_REDIS_URL's, with the mesh's other metadata (which "
        "need not survive a restart: the kv-store shards announce again what they hold).",
    )
    responses_ttl_s: float = Field(
        86400.0,
        gt=0,
        description="How long a response of /v1/responses stored in Redis (`store`, its default) can be read back "
        "or continued (`previous_response_id`). Without MESH_REDIS_URL none is stored.",
    )
    model_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long a request for a model of MESH_MODELS that no active worker serves (not placed yet, "
        "evicted, its workers restarting) waits for one, within its deadline; then 503.",
    )
    missed_heartbeats: int = Field(3, description="A worker silent this many heartbeat periods is dead.")
    policy: str = Field("least_loaded", description="Dispatch policy (llmesh.policies): " + ", ".join(POLICIES) + ".")
    policy_params: dict[str, float] = Field(
        default_factory=dict,
        description='The policy\'s parameters as JSON, e.g. {"threshold": 1.5} for banaserve; '
        "see each policy's docstring.",
    )
    queue_policy: str = Field(
        "fcfs",
        description="Order of the requests waiting for room, and which to refuse "
        "(llmesh.policies.queueing): " + ", ".join(QUEUE_POLICIES) + ".",
    )
    queue_policy_params: dict[str, float] = Field(
        default_factory=dict, description="The queue policy's parameters as JSON."
    )
    queue_max_waiting: int = Field(
        1024, ge=0, description="Requests that may wait for a worker with room; past it, 429 with Retry-After."
    )
    queue_max_wait_s: float = Field(
        10.0,
        gt=0,
        description="Longest wait for a worker with room (and never past "
        "the request's deadline); a request expected to wait longer, or that does, "
        "gets 429 with Retry-After.",
    )
    prefill_max_queue_s: float | None = Field(
        1.0,
        gt=0,
        description="A prefill worker takes prompts while those it holds, the new one included, take at "
        "most this long at its measured prefill speed (an idle one takes any); the rest wait in the router's queue, "
        "in MESH_QUEUE_POLICY's order, bounded by MESH_QUEUE_MAX_WAIT_S. Empty: up to the worker's capacity in "
        "requests (its engine then queues them, with no bound on the wait).",
    )
    seed: int = Field(0, description="Seed of the policy's tie-breaking random source.")
    local_prefill_margin_s: float | None = Field(
        0.25,
        ge=0,
        description="Run a whole request on a decode worker when that computes its prompt sooner "
        "than the prefill queue by more than this (llmesh.policies.disagg); empty: always disaggregate.",
    )
    slo_tpot_ms: float = Field(
        50.0,
        gt=0,
        description="Time per output token the streams should stay within: a decode worker takes a "
        "whole request only if every stream on it that can still meet this (its remaining tokens at the "
        "worker's current step time) still does after the stall of computing the prompt "
        "(llmesh.policies.disagg.stall_budget).",
    )
    length_sample_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Fraction of requests whose output length is predicted when the dispatch "
        "policy does not read predictions (beside the prefill, never delaying it): for traces, the predictor's "
        "online scoring and refit samples. Policies that read them get every request predicted before dispatch.",
    )
    length_predict_timeout_s: float = Field(
        0.1,
        gt=0,
        description="How long a request waits for the length "
        "predictor; past it, it is dispatched without a prediction.",
    )

    @model_validator(mode="after")
    def _known_policy(self) -> "RouterSettings":
        self.dispatch_policy()  # an unknown policy or parameter fails at start, not at the first request
        self.admission_policy()
        self.keyring()  # and a broken key file
        self.admin_keyring()
        return self

    def keyring(self) -> KeyRing:
        """The API keys: MESH_API_KEYS and the key file (default: the one in MESH_SECRETS_DIR)."""
        file = self.api_keys_file or (self.secrets_dir / API_KEYS_FILE if self.secrets_dir else None)
        return KeyRing.load(self.api_keys, file)

    def admin_keyring(self) -> KeyRing:
        """The admin endpoints' keys: MESH_ADMIN_API_KEYS and their key file (default: MESH_SECRETS_DIR's)."""
        file = self.admin_api_keys_file or (self.secrets_dir / ADMIN_KEYS_FILE if self.secrets_dir else None)
        return KeyRing.load(self.admin_api_keys, file if file is None or file.exists() else None)

    def dispatch_policy(self) -> Policy:
        return make_policy(self.policy, self.policy_params)

    def admission_policy(self) -> QueuePolicy:
        return make_queue_policy(self.queue_policy, self.queue_policy_params)
