"""Configuration from environment variables, parsed once in each service's `__main__`.

Every setting has a documented default; `MESH_` is the prefix (e.g. `MESH_NATS_URL`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

EMBEDDED_MODEL = "llmesh/tiny-llama"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESH_", extra="ignore")

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated.")
    log_level: str = Field("INFO", description="Python logging level.")
    otlp_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT", "MESH_OTLP_ENDPOINT"),
        description="OTLP/HTTP collector (e.g. Jaeger at http://jaeger:4318); unset disables export.",
    )
    trace_dir: str | None = Field(None, description="Also write spans as JSON lines into this directory.")
    redis_url: str = Field(
        "",
        description="Redis for shared metadata (e.g. redis://127.0.0.1:6379/0); "
        "empty: none (each kv-store shard then knows only its own chunks).",
    )
    secrets_dir: Path | None = Field(
        None,
        description="The mesh's credentials (`python -m llmesh.deploy.credentials DIR`; `make run` keeps them in "
        ".mesh-secrets): a NATS or Redis URL without a password gets this service's from there, and where NATS "
        "uses TLS (`MESH_NATS_TLS` when they were made) the service reaches it over TLS trusting only the CA there.",
    )
    # the NATS user this service connects as (llmesh.deploy.credentials.PERMISSIONS)
    NATS_USER: ClassVar[str] = "admin"

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object, info: ValidationInfo) -> object:
        """An empty variable sets an optional setting to None ("empty: ..." in the descriptions)."""
        if value == "" and info.field_name is not None:
            if type(None) in get_args(cls.model_fields[info.field_name].annotation):
                return None
        return value

    @model_validator(mode="after")
    def _credentials(self) -> CommonSettings:
        if self.secrets_dir is not None:
            from llmesh.wire.secrets import MeshSecrets, trusting_nats_ca, url_user

            secrets = MeshSecrets.load(self.secrets_dir)
            if not url_user(self.nats_url):
                self.nats_url = secrets.nats_url(self.nats_url, self.NATS_USER)
            else:  # a user of its own, and the deployment's CA all the same
                self.nats_url = trusting_nats_ca(self.nats_url, self.secrets_dir)
            if self.redis_url and "@" not in self.redis_url:
                self.redis_url = secrets.redis_url(self.redis_url)
        return self


class ConnectorConfig(BaseModel):
    """The mesh KV connector's settings, from the worker's (`llmesh.engine.worker.engine_args`) into vLLM's
    `kv_connector_extra_config` (`as_extra`) and back in every engine process (`from_extra`), validated.
    The settings' meanings and defaults are `WorkerSettings`' `kv_*` fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nats_url: str
    redis_url: str
    service_name: str  # names the connector's NATS connections and its spans' service
    control_subject: str | None  # where the decode worker commands its connector (`DurableTail`)
    otlp_endpoint: str | None
    trace_dir: str | None
    load_mode: Literal["layerwise", "async"]
    pin_s: float = Field(ge=0)
    timeout_s: float = Field(gt=0)
    reuse_prefix: bool
    write_behind: bool
    durable_tail: bool
    preemption: Literal["auto", "swap", "recompute"]
    kv_heads_per_chunk: int = Field(ge=0)
    # priors for the swap-or-recompute choice until this engine has measured its own
    load_bytes_per_s: float = Field(1e9, gt=0)
    prefill_tokens_per_s: float = Field(2000.0, gt=0)
    pinned_pool_bytes: int = Field(1 << 30, ge=0)  # pinned host buffers for TCP transfers on a GPU host

    def as_extra(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_extra(cls, extra: dict | None) -> ConnectorConfig:
        return cls.model_validate(extra or {})


class WorkerSettings(CommonSettings):
    """Shared by prefill and decode workers: the engine must be configured identically on both."""

    NATS_USER: ClassVar[str] = "worker"

    worker_id: str = Field("", description="Unique worker name; default: <role>-<host>-<pid>.")
    model: str = Field(
        EMBEDDED_MODEL,
        description=f"HF model path or name; {EMBEDDED_MODEL!r} builds the embedded tiny random model.",
    )
    served_model_name: str = Field("", description="Name clients use in `model`; default: the model.")
    model_dir: Path = Field(Path.home() / ".cache" / "llmesh", description="Where the embedded model is built.")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(  # vLLM's ModelDType
        "bfloat16", description="Weights and KV dtype."
    )
    block_size: int = Field(128, description="KV block size in tokens (a multiple of 32 on CPU).")
    max_model_len: int = Field(2048, description="Context length the engine accepts.")
    kv_cache_gib: int = Field(1, ge=1, description="KV cache size in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE).")
    kv_blocks: int | None = Field(
        None,
        ge=1,
        description="KV blocks for the engine (vLLM's num_gpu_blocks_override), e.g. to give a "
        "worker less KV than its memory holds; they must hold `MESH_MAX_MODEL_LEN` tokens. Unset or empty: as "
        "many as the KV space holds.",
    )
    gpu_memory_utilization: float = Field(0.9, description="Fraction of GPU memory vLLM may use (GPU only).")
    cpu_cores: str = Field(
        "",
        description="CPU cores for the engine's compute threads, e.g. '0-3' (VLLM_CPU_OMP_THREADS_BIND), and "
        "for its scheduler process (llmesh.engine.vllm_plugin); empty: vLLM decides. `make run` gives prefill and "
        "decode separate halves of the machine.",
    )
    cpu_reserved_cores: int = Field(
        1,
        ge=0,
        description="Cores vLLM keeps off its compute threads on CPU (VLLM_CPU_NUM_OF_RESERVED_CPU). vLLM reserves "
        "one more when a KV connector is set; pinning it keeps the thread count, and so the numerics, "
        "equal to a plain engine's.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Devices (ranks) the engine splits each layer's heads across (vLLM's tensor "
        "parallelism). On CPU each rank needs its own cores: `MESH_CPU_CORES` as '0|1' (`make run` does that).",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Stages the engine splits its layers across (vLLM's pipeline parallelism). Not on "
        "CPU: vLLM 0.32's CPU backend fails at the first step with two stages, with or without the mesh.",
    )
    kv_heads_per_chunk: int = Field(
        0,
        ge=0,
        description="KV heads in one kv-store chunk (one block of one layer). Workers whose tensor "
        "parallel sizes differ (a prefill with 2 ranks, a decode with 1) exchange KV only when this is the same "
        "on all and divides every rank's share of the heads: set it to the smallest such share. 0: one rank's "
        "share, so workers of the same size use the fewest chunks.",
    )
    enforce_eager: bool = Field(True, description="Disable graph capture (required on CPU).")
    engine_spin_s: float | None = Field(
        None,
        ge=0,
        description="How long the engine's scheduler and model processes busy-wait for each other "
        "before sleeping (vLLM: 1 s, keeping two processes per active engine at 100% CPU). Empty: 0.02 on CPU, "
        "where the mesh's services need those cores (measured: a third less engine CPU at the same latency), "
        "vLLM's own on GPU hosts. Applied by the llmesh vLLM plugin (llmesh.engine.vllm_plugin).",
    )
    capacity: int = Field(
        256,
        ge=1,
        description="Requests a worker accepts at once (more get 503), and its "
        "engine's batch limit (vLLM's max_num_seqs; vLLM's server defaults to 256 here).",
    )
    heartbeat_s: float = Field(1.0, description="Heartbeat period; the router drops a worker after 3 misses.")
    worker_metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds.")
    worker_metrics_port: int = Field(
        0,
        ge=0,
        description="Serve the engine's own Prometheus metrics (vLLM's `vllm:*`: KV cache usage, "
        "preemptions, prefix cache hits...) on this port; 0: none, and vLLM keeps no per-step statistics.",
    )
    kv_pin_s: float = Field(60.0, description="How long prefilled KV stays pinned in the kv-store for its decode.")
    kv_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest wait for one kv-store transfer (connecting included): past it a load is a "
        "miss that the engine recomputes and a put is dropped, so a shard that hangs (its host cut off) stalls the "
        "engine that long at most.",
    )
    kv_reuse_prefix: bool = Field(
        True,
        description="Prefill loads a prompt's leading blocks that any instance "
        "already stored instead of recomputing them.",
    )
    kv_write_behind: bool = Field(
        True,
        description="Decode writes the KV of generated tokens back to the kv-store "
        "block by block, so a conversation's next turn finds its whole history there.",
    )
    kv_durable_tail: bool = Field(
        False,
        description="Decode also writes a request's partial last KV block every step, so that after its "
        "worker dies the request resumes elsewhere computing only its last token (greedy output stays exact) "
        "instead of recomputing up to a block of tokens (exact but for near-ties). Costs one block per layer "
        "per step of store traffic.",
    )
    switchable: bool = Field(
        False,
        description="A decode worker that also serves prefill (one engine holding both KV roles): the "
        "`role` in its heartbeat says which the routers send it, and the placement service switches it as load "
        "shifts (BanaServe's adaptive module migration). Switched to prefill, its decodes migrate to the decode "
        "pool; switched to decode, it finishes the prompts it holds.",
    )
    length_refine_every: int = Field(
        64,
        ge=0,
        description="Decode workers ask the length predictor for a running request's remaining output "
        "every this many generated tokens (past eight times that, every eighth of what it has generated), in the "
        "background, off the engine's path, and report it on heartbeats; 0: never.",
    )
    kv_preemption: Literal["auto", "swap", "recompute"] = Field(
        "auto",
        description="A request vLLM preempted under memory pressure resumes by loading its KV from the "
        "kv-store ('swap') or by computing it again ('recompute'); 'auto' picks the cheaper per request from the "
        "load bandwidth and prefill throughput the engine measures (AdaptiveLLM).",
    )
    kv_load_mode: Literal["layerwise", "async"] = Field(
        "layerwise",
        description="'layerwise': load layer i+1 while computing layer i; "
        "'async': load all layers before the request is scheduled.",
    )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
