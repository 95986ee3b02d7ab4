"""Configuration from environment variables, parsed once in each service's `__main__`.

Every setting has a documented default; `MESH_` is the prefix (e.g. `MESH_NATS_URL`).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmesh.wire.messages import ROLES, LoraAdapter, Role

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
    # its settings that name a Redis: given without a password, they get the deployment's from the secrets
    REDIS_URLS: ClassVar[tuple[str, ...]] = ("redis_url",)

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
            for field in self.REDIS_URLS:
                url = getattr(self, field)
                if url and "@" not in url:
                    setattr(self, field, secrets.redis_url(url))
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


def name_tag(model: str) -> str:
    """`model`'s name as a part of a process's or worker's name: its letters and digits, the rest dashes."""
    return "".join(c if c.isalnum() else "-" for c in model).strip("-")


# vLLM engine arguments that the mesh sets itself: a catalogue entry's `engine_args` may not (what to use instead)
MESH_ENGINE_ARGS = {
    "model": "the entry's `model`",
    "served_model_name": "the entry's `name`",
    "kv_transfer_config": "the mesh's KV connector (the MESH_KV_* settings)",
    "block_size": "MESH_BLOCK_SIZE (the kv-store keeps KV in blocks of that size)",
    "tensor_parallel_size": "the entry's `tensor_parallel_size`",
    "pipeline_parallel_size": "MESH_PIPELINE_PARALLEL_SIZE",
    "data_parallel_size": "more workers (each worker's engine is one data-parallel replica; the router balances them)",
    "distributed_executor_backend": "nothing: the mesh runs a process a rank",
    "logits_processors": "nothing: the mesh's own (penalties and bad words that hold across engines)",
    "reasoning_parser": "the entry's `reasoning_parser`",
    "disable_log_stats": "MESH_WORKER_METRICS_PORT",
    "kv_cache_memory_bytes": "MESH_KV_CACHE_BYTES",
    "skip_tokenizer_init": "nothing: workers tokenize their prompts",
    "hf_token": "HF_TOKEN or HF_TOKEN_PATH (a token does not belong in MESH_MODELS)",
}


class ServedModel(BaseModel):
    """One model of the mesh's catalogue (`MESH_MODELS`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="What clients send in `model`.")
    model: str = Field(
        EMBEDDED_MODEL,
        min_length=1,
        description="A Hugging Face hub name, a folder of weights, a folder's name in MESH_MODEL_DIR, or an "
        "embedded model.",
    )
    ttft_slo_ms: float | None = Field(None, gt=0, description="Its requests' time-to-first-token target.")
    tpot_slo_ms: float | None = Field(None, gt=0, description="Its requests' time-per-output-token target.")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks each of its engines splits its layers' heads across.")
    disaggregated: bool = Field(
        True,
        description="Prompts on prefill workers, the rest on decode workers (KV handed over layer by layer). "
        "False: aggregated, as vLLM serves alone: decode workers only, each running whole requests, one engine "
        "per replica instead of two (for models too small for the hand-over to pay, or hosts short of cores).",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's parser of the model's own tool-call format (its `--tool-call-parser`: \"hermes\", "
        '"llama3_json", "mistral", "pythonic", ...), with which the router reads a chat\'s calls as vLLM\'s server '
        'does with it: "auto" (the default with tools), and "required" and named calls, constrained in that format '
        'where the parser has one. None: "auto" is refused, as vLLM\'s server refuses it without '
        "`--enable-auto-tool-choice`, and forced calls are JSON.",
    )
    reasoning_parser: str | None = Field(
        None,
        description='vLLM\'s parser of the model\'s reasoning (its `--reasoning-parser`: "deepseek_r1", "qwen3", '
        "...): the router parts a chat's output into `reasoning` and `content` as vLLM's server does, and its "
        "engines hold a structured output's constraint (a forced tool call's too) until the reasoning ends.",
    )

    lora_modules: list[LoraAdapter] = Field(
        default_factory=list,
        description='LoRA adapters its workers load at start and serve, as vLLM\'s --lora-modules: [{"name": '
        '"sql", "path": "/models/sql-lora"}, ...] (a folder, a folder\'s name in MESH_MODEL_DIR, or a hub name); '
        "clients send an adapter's name in `model`. More are loaded at run time through /v1/load_lora_adapter "
        '(an admin key), where `engine_args` has {"enable_lora": true} or the entry has adapters here; vLLM\'s '
        "max_loras, max_lora_rank and max_cpu_loras go in `engine_args`.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine arguments of its engines, by the names of vLLM's `AsyncEngineArgs` (its CLI's "
        'without the dashes, either spelling), e.g. {"quantization": "fp8", "kv_cache_dtype": "fp8", '
        '"max_num_batched_tokens": 8192, "trust_remote_code": true, "revision": "main"}; over the workers\' '
        "MESH_* engine settings where both set one (dtype, max_model_len, max_num_seqs, enforce_eager, "
        "gpu_memory_utilization, num_gpu_blocks_override). Read by vLLM's own argument parser before any engine "
        "starts: an unknown name or a bad value is an error naming it. Those the mesh sets itself are refused "
        "(llmesh.wire.config.MESH_ENGINE_ARGS says what to set instead).",
    )

    @field_validator("engine_args")
    @classmethod
    def _engine_args_not_the_meshs(cls, given: dict[str, Any]) -> dict[str, Any]:
        args: dict[str, Any] = {}
        for key, value in given.items():
            name = key.lstrip("-").replace("-", "_")
            if name in args:
                raise ValueError(f"engine_args sets {name!r} twice")
            if name in MESH_ENGINE_ARGS:
                raise ValueError(f"engine_args: the mesh sets {name!r} itself; set {MESH_ENGINE_ARGS[name]}")
            args[name] = value
        return args

    @property
    def serves_lora(self) -> bool:
        """Its engines run LoRA adapters: it has some, or its `engine_args` turn LoRA on."""
        return bool(self.lora_modules or self.engine_args.get("enable_lora"))

    def tokenizer_args(self) -> dict[str, Any]:
        """What loading its tokenizer outside an engine takes from its engine arguments (as vLLM's engine
        loads it)."""
        args = self.engine_args
        return {
            "tokenizer_name": args.get("tokenizer") or self.model,
            "revision": args.get("tokenizer_revision") or args.get("revision"),
            "trust_remote_code": bool(args.get("trust_remote_code")),
            **({"tokenizer_mode": args["tokenizer_mode"]} if "tokenizer_mode" in args else {}),
        }

    @property
    def roles(self) -> tuple[Role, ...]:
        """The worker roles that serve it."""
        return ROLES if self.disaggregated else ("decode",)


def model_roles(catalogue: Mapping[str, ServedModel], model: str) -> tuple[Role, ...]:
    """The roles of the workers that serve `model` (the first runs its prompts): its catalogue entry's;
    outside the catalogue (workers started by hand), both."""
    entry = catalogue.get(model)
    return entry.roles if entry else ROLES


class ModelSettings(BaseSettings):
    """The models the mesh serves: the catalogue every service reads the same way (`catalogue`)."""

    model_config = SettingsConfigDict(env_prefix="MESH_", extra="ignore")

    models: list[ServedModel] | None = Field(
        None,
        description="The models the mesh serves, as a JSON list of {name, model, ttft_slo_ms, tpot_slo_ms, "
        "tensor_parallel_size, disaggregated, tool_call_parser, reasoning_parser, lora_modules, engine_args}, e.g. "
        '[{"name": "chat", "model": "meta-llama/Llama-3.1-8B-Instruct", "tool_call_parser": "llama3_json"}]; '
        "a worker serves the one MESH_SERVED_MODEL_NAME names (default: the first). The router lists them all and "
        "a request for one that no worker serves waits for one (MESH_MODEL_WAIT_S); other names get 404. `make run` "
        "starts workers for each, or for those MESH_STARTED_MODELS lists (comma-separated). Empty: the one model "
        "MESH_MODEL and MESH_SERVED_MODEL_NAME say.",
    )
    model: str = Field(
        EMBEDDED_MODEL,
        min_length=1,
        description=f"A Hugging Face hub name, a folder of weights, or a folder's name in MESH_MODEL_DIR; "
        f"{EMBEDDED_MODEL!r} builds the embedded tiny random model. With MESH_MODELS: taken from there.",
    )
    served_model_name: str = Field("", description="Name clients use in `model`; default: the model.")
    model_dir: Path = Field(
        Path.home() / ".cache" / "llmesh",
        description="A folder of models: a model named by a folder's name in it (`MESH_MODEL=Llama-3.1-8B-Instruct`, "
        '`"model"` in MESH_MODELS) is loaded from there, and the embedded model is built there. Compose mounts '
        "the host's MESH_MODEL_DIR (default: a volume) there as /models.",
    )
    hf_token: SecretStr | None = Field(
        None,
        validation_alias="HF_TOKEN",
        description="A Hugging Face token, for gated models and private repositories (read by huggingface_hub and "
        "vLLM themselves, in every service that loads weights or a tokenizer: workers, host agents, the router). "
        "Kept out of logs; workers log where their token comes from.",
    )
    hf_token_path: Path | None = Field(
        None,
        validation_alias="HF_TOKEN_PATH",
        description="A file holding that token, instead (huggingface_hub's variable; compose mounts "
        "MESH_HF_TOKEN_FILE there as a secret; `make run` points it at the secrets' `hf-token` file if there is one).",
    )

    @field_validator("models", "hf_token", "hf_token_path", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    def hf_token_source(self) -> str:
        """Where this process's Hugging Face token comes from, for its log (never the token)."""
        if self.hf_token is not None:
            return "HF_TOKEN"
        if self.hf_token_path is not None:
            return f"the file {self.hf_token_path}" + ("" if self.hf_token_path.is_file() else " (missing: none)")
        return "none (public models only)"

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ServedModel] | None) -> list[ServedModel] | None:
        names = [m.name for m in models or ()] + [a.name for m in models or () for a in m.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"model and adapter names must be unique: {names}")
        return models

    @model_validator(mode="after")
    def _from_catalogue(self) -> ModelSettings:
        """With a catalogue, `model` and `served_model_name` are its entry's (the first unless named)."""
        if not self.models:
            return self
        entry = self.served_model() if self.served_model_name else self.models[0]
        if "model" in self.model_fields_set and self.model != entry.model:
            raise ValueError(f"MESH_MODEL={self.model!r} differs from MESH_MODELS' {entry.name!r} ({entry.model!r})")
        self.model, self.served_model_name = entry.model, entry.name
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def catalogue(self) -> list[ServedModel]:
        """Every model the mesh serves."""
        return self.models or [ServedModel(name=self.model_name, model=self.model)]

    def served_model(self) -> ServedModel:
        """This service's model (a worker's): the catalogue's entry for MESH_SERVED_MODEL_NAME."""
        found = [m for m in self.catalogue() if m.name == self.model_name]
        if not found:
            raise ValueError(
                f"MESH_SERVED_MODEL_NAME={self.model_name!r} is not in MESH_MODELS "
                f"({', '.join(m.name for m in self.catalogue())})"
            )
        return found[0]


class HostSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESH_", extra="ignore")

    host_id: str = Field(
        "",
        description="The host this process runs on, as placement knows it (its host agent's id); default: the "
        "host name.",
    )

    kv_cache_gib: int = Field(
        1,
        ge=1,
        description="A worker's KV cache in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE), unless placement gives it "
        "a share; a host agent's default budget holds two such engines per model.",
    )

    def host(self) -> str:
        return self.host_id or socket.gethostname()


class ScalingSettings(BaseSettings):
    """Autoscaling's bounds: placement acts within them, and `make run` gives each engine its share of the cores
    for the most decode workers a model may have (llmesh.deploy.launcher.engine_cores)."""

    model_config = SettingsConfigDict(env_prefix="MESH_", extra="ignore")

    placement_autoscale: bool = Field(
        False,
        description="Scale decode workers per model through the host agents (Llumnix's autoscaling): when their "
        "mean freeness over `MESH_PLACEMENT_SCALE_WINDOW_S` is under the band, activate one; when over it for "
        "`MESH_PLACEMENT_SCALE_DOWN_WINDOW_S` and the others would stay in it without one, drain the one with the "
        "fewest requests (they migrate; it exits). Off: advice only.",
    )
    placement_min_decode_workers: int = Field(1, ge=1, description="Autoscaling keeps at least this many per model ...")
    placement_max_decode_workers: int = Field(4, ge=1, description="... and starts no more than this many.")

    def decode_workers_at_most(self, started: int) -> int:
        """The most decode workers a model has at once when `started` are started with it."""
        return max(started, self.placement_max_decode_workers) if self.placement_autoscale else started


class WorkerSettings(ModelSettings, HostSettings, CommonSettings):
    """Shared by prefill and decode workers: the engine must be configured identically on both."""

    NATS_USER: ClassVar[str] = "worker"

    worker_id: str = Field("", description="Unique worker name; default: <role>-<host>-<pid>.")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(  # vLLM's ModelDType
        "auto", description="Weights and KV dtype; auto: the checkpoint's (a model's `engine_args` may say otherwise)."
    )
    block_size: int = Field(128, ge=1, description="KV block size in tokens (a multiple of 32 on CPU).")
    max_model_len: int | None = Field(
        2048,
        ge=1,
        description="Context length the engine accepts (a model's `engine_args` may say otherwise). Empty: the "
        "model's own (the compose files' default: a GPU holds it).",
    )
    kv_cache_bytes: int = Field(
        0,
        ge=0,
        description="KV space of the engine in bytes, over its ranks (vLLM's kv_cache_memory_bytes, on CPU and GPU "
        "alike), raised to what one `MESH_MAX_MODEL_LEN` sequence needs; 0: `MESH_KV_CACHE_GIB` on CPU, "
        "`MESH_GPU_MEMORY_UTILIZATION` on GPU. A host agent sets it to the share placement gives the worker.",
    )
    kv_blocks: int | None = Field(
        None,
        ge=1,
        description="KV blocks for the engine (vLLM's num_gpu_blocks_override), e.g. to give a "
        "worker less KV than its memory holds; they must hold `MESH_MAX_MODEL_LEN` tokens. Unset or empty: as "
        "many as the KV space holds.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (GPU only)."
    )
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
        gt=0,
        description="How long the engine's scheduler and model processes busy-wait for each other "
        "before sleeping (vLLM: 1 s, keeping two processes per active engine at 100% CPU). Empty: 0.02 on CPU, "
        "where the mesh's services need those cores (measured: a third less engine CPU at the same latency), "
        "vLLM's own on GPU hosts. Above 0: with none, vLLM's wake-up notices get lost and steps wait 5 s "
        "(measured). Applied by the llmesh vLLM plugin (llmesh.engine.vllm_plugin).",
    )
    capacity: int = Field(
        256,
        ge=1,
        description="Requests a worker accepts at once (more get 503), and its "
        "engine's batch limit (vLLM's max_num_seqs; vLLM's server defaults to 256 here). A model's `engine_args` "
        "with `max_num_seqs` set it to that.",
    )
    heartbeat_s: float = Field(1.0, gt=0, description="Heartbeat period; the router drops a worker after 3 misses.")
    worker_metrics_host: str = Field("127.0.0.1", description="Address the /metrics endpoint binds.")
    worker_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Serve the engine's own Prometheus metrics (vLLM's `vllm:*`: KV cache usage, "
        "preemptions, prefix cache hits...) on this port; 0: none, and vLLM keeps no per-step statistics.",
    )
    kv_pin_s: float = Field(
        60.0, ge=0, description="How long prefilled KV stays pinned in the kv-store for its decode."
    )
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

    modelled_engine: str = Field(
        "",
        description="Benchmarks only: instead of vLLM, an engine that computes nothing and times its steps by this "
        "simulator profile (a name in sim/profiles, e.g. h100-llama2-7b, or a JSON path), behind the same worker "
        "services (llmesh_sim.modelled_engine), to measure the control plane at GPU speed without a GPU. Empty: vLLM.",
    )
    modelled_kv_bytes_per_token: int | None = Field(
        None,
        ge=0,
        description="With `MESH_MODELLED_ENGINE`: the KV bytes a token that its prefills write to the kv-store and "
        "its decodes read; empty: the profiled model's; 0: no KV crosses the store.",
    )
    modelled_timings_dir: str = Field(
        "",
        description="With `MESH_MODELLED_ENGINE`: each request's time from reaching the engine to its first token "
        "out, written to a file a worker in this folder (request id and seconds a line), for a benchmark to "
        "subtract from what its client saw; empty: none.",
    )

    @model_validator(mode="after")
    def _from_the_models_entry(self) -> WorkerSettings:
        """Its catalogue entry's tensor parallel size, and its `engine_args`' `max_num_seqs` as the capacity."""
        served = self.served_model()
        if self.models and "tensor_parallel_size" not in self.model_fields_set:
            self.tensor_parallel_size = served.tensor_parallel_size
        seqs = served.engine_args.get("max_num_seqs")
        if seqs is not None:
            if "capacity" in self.model_fields_set and self.capacity != seqs:
                raise ValueError(f"MESH_CAPACITY={self.capacity} differs from {served.name!r}'s max_num_seqs {seqs}")
            if not isinstance(seqs, int) or seqs < 1:
                raise ValueError(f"{served.name!r}: engine_args' max_num_seqs must be a positive integer, not {seqs!r}")
            self.capacity = seqs
        return self
