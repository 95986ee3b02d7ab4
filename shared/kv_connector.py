"""The mesh's vLLM KV connector: moves whole KV blocks, layer by layer, through the kv-store.

Loaded by vLLM with `kv_connector="MeshKVConnector"`, `kv_connector_module_path="llmesh.kv_connector"`.

Producer (prefill): `save_kv_layer` gathers the request's finished blocks of that layer and
puts them to the kv-store at once (the put overlaps the next layers' compute); the last,
partial block is saved too once the whole prompt is computed. `wait_for_save` waits for the
step's puts; `request_finished` returns the block hashes in `kv_transfer_params`. Before
that, `get_num_new_matched_tokens` asks the kv-store which of the prompt's leading full
blocks any instance already stored (every layer): those are loaded, not recomputed, and not
saved again (prefix reuse across instances; keys depend only on fingerprint, token-block
hash chain and layer; the chain starts from the request's cache salt and LoRA adapter too,
so tenants and adapters never share a chunk).

Consumer (decode): the mesh sends decode the prompt plus every output token so far (after a
prefill, its first token; after a migration or a failover, all it streamed), so decode loads
the KV of all but the last token and computes just that one, the same computation as a
monolithic engine's next decode step: outputs stay bit-identical. `get_num_new_matched_tokens`
reports the tokens whose blocks the request's `KvHandle` lists (re-hashed from our own tokens,
so a tokenization mismatch cannot load wrong KV; an exported tail block is taken as named),
and looks the store up for the blocks past them (a request this worker did not get a handle for).
`start_load_kv` requests every layer at once (prefill and decode load alike); each layer is
copied into the cache by the transfer thread as it arrives. In `layerwise` mode the request runs in the
same step and `wait_for_layer_load` blocks only for its own layer, so layer i+1 arrives
while layer i computes. In `async` mode the request waits outside the batch until all
layers are in (other requests keep decoding meanwhile). Decode also writes back, without
waiting, each block that generation fills (write-behind), so the next turn of a conversation
finds its whole history in the store; with `durable_tail` it also writes the partial last block
every step, so a failover loses at most the step in flight; a migration's source turns that on for
the request it is handing over (`DurableTail` on `control_subject`), so at the switch its tail is
already stored. A request aborted while it carries a `tail_id` (a migration's source stops it so)
exports its last two blocks under `kvkeys.tail_hash` keys, and any full block not yet written, before
its blocks are freed (the hand-over falls back on these). A missing chunk is reported
as a load error and vLLM recomputes those blocks (`kv_load_failure_policy="recompute"`).

A worker built with both roles (`kv_both`, a switchable decode worker) treats each request by what
it is: one the prefill service sent (`do_remote_decode`) as a producer's, any other as decode's.

Preemption (AdaptiveLLM): when vLLM preempts a request under memory pressure it frees its blocks;
when the request resumes, the connector either loads what the store holds of it (decode writes its
blocks behind as they fill) or lets vLLM compute it again, whichever `llmesh.policies.preemption`
finds cheaper with the load bandwidth and prefill throughput this engine measured (the worker side
reports both every step). The choices made for a request return with it (`kv_transfer_params`).

Tensor parallelism: each rank's connector saves and loads only the chunks of the KV heads it holds
(`kvkeys` names a chunk by block, layer and head group), so a decode of one tensor-parallel size loads
what a prefill of another computed, with nothing reshuffled on either side. The scheduler side looks
a block up whole (every layer, every head group), whatever ranks it has.

Per-layer views are vLLM's `[blocks, KV heads, tokens, K|V]` on every backend, so the same
gather/scatter serves CPU and GPU; only the `.cpu()` copy differs in cost.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from llmesh import telemetry
from llmesh.errors import InvalidRequest, MeshError
from llmesh.kvclient import FillGuard, ThreadedKvClient
from llmesh.kvkeys import (
    block_hashes,
    chain_seed,
    chunk_key,
    directory_digest,
    fingerprint,
    kv_layout,
    rank_first_head,
    rank_heads,
    tail_hash,
)
from llmesh.messages import Ack, DurableTail, Message
from llmesh.policies.preemption import RateEstimate, swap_or_recompute

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("llmesh.kv_connector")

PREFILL_SAMPLE_TOKENS = 64  # steps computing fewer tokens (decode steps) say little about prefill throughput


@dataclass
class BlockTransfer:
    """Blocks of one request to move this step: vLLM block ids paired with chain hashes."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]
    trace: dict[str, str] = field(default_factory=dict)  # W3C headers of the worker's request span
    last_block_tokens: int = 0  # loads: valid token slots of the last block, if it is partial
    wait: bool = False  # saves: the step waits for them (a prefill's, for its decode)


@dataclass(frozen=True)
class HeadSlice:
    """The KV heads of one chunk within a rank's cache: their group (`kvkeys.chunk_key`) and place."""

    group: int
    start: int
    count: int


def rank_slices(layout: dict[str, Any], tensor_parallel_size: int, rank: int) -> list[HeadSlice]:
    """The head groups a tensor-parallel rank holds, in the order of its cache's heads."""
    total, per = layout["num_kv_heads"], layout["kv_heads_per_chunk"]
    first = rank_first_head(total, tensor_parallel_size, rank)
    return [HeadSlice((first + start) // per, start, per)
            for start in range(0, rank_heads(total, tensor_parallel_size), per)]


@dataclass
class MeshConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    exports: list[BlockTransfer] = field(default_factory=list)  # blocks of stopped requests, then freed
    step_tokens: int = 0  # tokens the step computes


@dataclass
class MeshWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: what loads and compute cost, for the swap-or-recompute choice."""

    load_bytes: int = 0
    load_s: float = 0.0
    compute_tokens: int = 0  # a step without loads that computed many tokens (a prefill)
    compute_s: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, MeshWorkerMetadata)
        return MeshWorkerMetadata(self.load_bytes + other.load_bytes, self.load_s + other.load_s,
                                  max(self.compute_tokens, other.compute_tokens), max(self.compute_s, other.compute_s))


@dataclass
class _SaveState:
    """Scheduler-side progress of saving one prompt's full blocks."""

    hashes: list[str]  # the prompt's blocks, the trailing partial one included
    num_tokens: int
    block_ids: list[int]
    saved: int = 0
    trace: dict[str, str] = field(default_factory=dict)
    producer: bool = False  # a prefill's prompt (else a decode's blocks, written behind)


@dataclass
class _PendingLoad:
    """Worker-side: one request's layers being fetched."""

    transfer: BlockTransfer
    futures: dict[str, concurrent.futures.Future]  # layer name -> values
    span: Any
    failed: bool = False
    started: float = field(default_factory=time.perf_counter)
    last_arrival: float = 0.0


def _log_to_stderr() -> None:
    """The engine's processes configure only vLLM's loggers: show ours (INFO and up) beside them."""
    root = logging.getLogger("llmesh")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def _layer_index(name: str) -> int:
    match = re.search(r"\.(\d+)\.", name)
    return int(match.group(1)) if match else 0


def _tail_id(request: Any) -> str | None:
    """The id a decode worker named the request's exported blocks by (`kvkeys.tail_hash`), if any."""
    return (getattr(request, "kv_transfer_params", None) or {}).get("tail_id")


def request_trace(request: Any) -> dict[str, str]:
    params = getattr(request, "kv_transfer_params", None) or {}
    return dict(params.get("trace") or {})


class MeshKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_to_stderr()
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._block_size = vllm_config.cache_config.block_size
        self._layout = kv_layout(vllm_config)
        self._fingerprint = fingerprint(self._layout)
        self._is_producer = self._kv_transfer_config.is_kv_producer
        self._is_consumer = self._kv_transfer_config.is_kv_consumer
        self._async_load = extra.get("load_mode", "layerwise") == "async"
        self._pin_s = float(extra.get("pin_s", 60.0))
        self._timeout_s = float(extra.get("timeout_s", 10.0))  # one transfer's longest wait: then recompute
        self._preemption = extra.get("preemption", "auto")  # or "swap" / "recompute" always
        if self._preemption not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption must be auto, swap or recompute, not {self._preemption!r}")
        # priors until this engine has measured them
        self._load_rate = RateEstimate(float(extra.get("load_bytes_per_s", 1e9)))
        self._prefill_rate = RateEstimate(float(extra.get("prefill_tokens_per_s", 2000.0)))
        config = self._kv_cache_config
        self._block_bytes = sum(t.size for t in config.kv_cache_tensors) // max(config.num_blocks, 1)  # all layers
        self._preemptions: dict[str, dict[str, int]] = {}  # request id -> choice -> times
        self._decided: dict[str, int] = {}  # request id -> the preemption its resume was decided for
        # scheduler side
        self._load_plans: dict[str, tuple[int, list[str]]] = {}  # tokens computed before, block hashes
        self._reused_blocks: dict[str, int] = {}  # prefill: leading blocks loaded, so not saved again
        self._write_behind = self._is_consumer and bool(extra.get("write_behind", True))
        self._durable_tail = self._write_behind and bool(extra.get("durable_tail", False))
        self._requests: dict[str, Request] = {}  # decode, for write-behind: live requests by id
        self._seeds: dict[str, str] = {}  # request id -> the start of its block-hash chain
        self._adapters: dict[str, str] = {}  # LoRA adapter path -> its content digest
        self._planned_loads: list[BlockTransfer] = []
        self._planned_exports: list[BlockTransfer] = []
        self._saves: dict[str, _SaveState] = {}
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._loads: dict[str, _PendingLoad] = {}
        self._pending_puts: list[tuple[concurrent.futures.Future, FillGuard, str]] = []
        self._write_behind_puts: list[tuple[concurrent.futures.Future, str]] = []
        self._load_errors: set[int] = set()
        self._measured = MeshWorkerMetadata()
        self._step_started = 0.0
        self._finished_loads: set[str] = set()
        self._exported: set[str] = set()
        self._kv: ThreadedKvClient | None = None
        self._lookup: ThreadedKvClient | None = None  # scheduler side: which prefix blocks are stored
        self._durable_tails: set[str] = set()  # tail ids of requests migrating away: their tail is durable
        if role == KVConnectorRole.SCHEDULER and (self._is_consumer or extra.get("reuse_prefix", True)):
            self._lookup = ThreadedKvClient(extra["nats_url"], f"{extra.get('service_name', 'vllm')}-lookup",
                                            threads=1, redis_url=extra.get("redis_url") or "", timeout=self._timeout_s)
            if self._write_behind and extra.get("control_subject"):
                self._lookup.serve(extra["control_subject"], self._on_control)
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
            self._slices = rank_slices(self._layout, tensor_parallel_size,
                                       get_tensor_model_parallel_rank() if tensor_parallel_size > 1 else 0)
            telemetry.setup_tracing(
                extra.get("service_name", "vllm-worker"),
                otlp_endpoint=extra.get("otlp_endpoint"),
                trace_dir=extra.get("trace_dir"),
            )
            self._tracer = telemetry.tracer("llmesh.kv_connector")
            self._kv = ThreadedKvClient(extra["nats_url"], f"{extra.get('service_name', 'vllm')}-connector",
                                        redis_url=extra.get("redis_url") or "", timeout=self._timeout_s)

    # ==== scheduler side ===================================================================

    async def _on_control(self, msg: Message, blob: memoryview) -> Ack:
        """The worker's commands (on the lookup client's thread): `DurableTail` for a migrating request."""
        if not isinstance(msg, DurableTail):
            raise InvalidRequest(f"expected DurableTail, got {type(msg).__name__}")
        if not msg.on:
            self._durable_tails.discard(msg.tail_id)
        elif msg.tail_id in {_tail_id(r) for r in list(self._requests.values())}:
            self._durable_tails.add(msg.tail_id)
        else:
            raise InvalidRequest(f"no request with tail id {msg.tail_id} is decoding here")
        return Ack()

    def _seed(self, request: Request) -> str:
        """The request's chain seed: the fingerprint, its cache salt and its LoRA adapter's content."""
        seed = self._seeds.get(request.request_id)
        if seed is None:
            lora = request.lora_request
            adapter = None
            if lora is not None:
                adapter = self._adapters.get(lora.lora_path)
                if adapter is None:
                    adapter = self._adapters[lora.lora_path] = directory_digest(lora.lora_path)
            seed = self._seeds[request.request_id] = chain_seed(self._fingerprint, request.cache_salt, adapter)
        return seed

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self._seed(request)  # build_connector_meta sees only the request's scheduling data
        params = request.kv_transfer_params or {}
        # decode: what its handle lists and the store holds (a whole request: once preempted, it stored its prompt)
        prefill = self._prefills(params)
        if not prefill and not params.get("recompute") and (not params.get("save_prompt") or request.num_preemptions):
            matched = self._match_handle(request, params, num_computed_tokens)
        elif prefill and self._lookup is not None:
            matched = self._match_stored_prefix(request, num_computed_tokens)
        else:
            return 0, False
        return self._after_preemption(request, num_computed_tokens, matched) if request.num_preemptions else matched

    def _prefills(self, params: dict[str, Any] | None) -> bool:
        """Whether a request is a prefill whose KV a decode elsewhere loads (a worker built with
        both roles serves both kinds; the prefill service marks its requests `do_remote_decode`)."""
        return not self._is_consumer or bool((params or {}).get("do_remote_decode"))

    def _after_preemption(self, request: Request, num_computed_tokens: int, matched: tuple[int, bool]) -> tuple[int, bool]:
        """A preempted request resumes: load its stored KV (swap) or let vLLM compute it (recompute)."""
        tokens = matched[0]
        if not tokens:
            return matched
        size = self._block_size
        blocks = -(-(num_computed_tokens + tokens) // size) - num_computed_tokens // size
        cost = swap_or_recompute(tokens, blocks * self._block_bytes, self._load_rate.per_s, self._prefill_rate.per_s,
                                 self._preemption)
        if self._decided.get(request.request_id) != request.num_preemptions:  # asked again while it waits
            self._decided[request.request_id] = request.num_preemptions
            choices = self._preemptions.setdefault(request.request_id, {})
            choices[cost.choice] = choices.get(cost.choice, 0) + 1
            log.info("request %s resumes after preemption %d: %s %d tokens (%d blocks; load ~%.1f ms at %.0f MB/s, "
                     "recompute ~%.1f ms at %.0f tokens/s)", request.request_id, request.num_preemptions, cost.choice,
                     tokens, blocks, cost.swap_s * 1e3, self._load_rate.per_s / 1e6, cost.recompute_s * 1e3,
                     self._prefill_rate.per_s)
        if cost.choice == "recompute":
            self._load_plans.pop(request.request_id, None)
            return 0, False
        return matched

    def _match_handle(self, request: Request, params: dict[str, Any], num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: the blocks of all but the last token that the request's KV handle lists, then
        those of the rest the store holds."""
        if params.get("fingerprint", self._fingerprint) != self._fingerprint:
            log.error("request %s: KV fingerprint %s does not match ours %s; recomputing",
                      request.request_id, params.get("fingerprint"), self._fingerprint)
            return 0, False
        # vLLM must compute at least the last token itself (after a preemption: all it generated too).
        loadable = request.all_token_ids[:-1]
        ours = block_hashes(self._seed(request), loadable, self._block_size, partial=True)
        listed = params.get("block_hashes") or []
        matched = 0
        while matched < min(len(ours), len(listed)) and ours[matched] == listed[matched]:
            matched += 1
        full = len(loadable) // self._block_size
        tail = params.get("tail_hash")
        # the partial last block, exported by a migration's source (it holds only what the source computed)
        if tail and matched == full < len(ours) and not request.num_preemptions:
            ours[full] = tail
            matched += 1
        elif matched < len(ours) and self._lookup is not None:
            matched += self._stored_run(request, ours[matched:])
        return self._plan_load(request, ours, min(matched * self._block_size, len(loadable)), num_computed_tokens)

    def _stored_run(self, request: Request, hashes: list[str]) -> int:
        """How many of `hashes`, from the first, the store holds whole (0 if it cannot say)."""
        assert self._lookup is not None
        try:
            return self._lookup.client.stored_run(hashes, self._layout)
        except MeshError as exc:
            log.warning("request %s: KV lookup failed (%s); computing it", request.request_id, exc)
            return 0

    def _match_stored_prefix(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prefill: the prompt's leading full blocks that any instance already stored (every
        layer of them): loaded instead of recomputed."""
        hashes = block_hashes(self._seed(request), (request.prompt_token_ids or [])[:-1], self._block_size)
        first = num_computed_tokens // self._block_size
        if first >= len(hashes):
            return 0, False
        matched = first + self._stored_run(request, hashes[first:])
        self._reused_blocks[request.request_id] = matched
        return self._plan_load(request, hashes, matched * self._block_size, num_computed_tokens)

    def _plan_load(self, request: Request, hashes: list[str], loadable_tokens: int,
                   num_computed_tokens: int) -> tuple[int, bool]:
        new_tokens = loadable_tokens - num_computed_tokens
        if new_tokens <= 0:
            return 0, False
        self._load_plans[request.request_id] = (num_computed_tokens, hashes)
        return new_tokens, self._async_load

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._seed(request)
        if self._write_behind:
            self._requests[request.request_id] = request  # its token ids grow as it decodes
        plan = self._load_plans.pop(request.request_id, None)
        if num_external_tokens == 0 or plan is None:
            return
        computed, hashes = plan
        first = computed // self._block_size
        last = -(-(computed + num_external_tokens) // self._block_size)  # a partial last block too
        block_ids = blocks.get_block_ids()[0]
        self._planned_loads.append(
            BlockTransfer(request.request_id, list(block_ids[first:last]), list(hashes[first:last]),
                          request_trace(request), (computed + num_external_tokens) % self._block_size)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MeshConnectorMetadata:
        meta = MeshConnectorMetadata(loads=self._planned_loads, exports=self._planned_exports,
                                     step_tokens=scheduler_output.total_num_scheduled_tokens)
        self._planned_loads, self._planned_exports = [], []
        if not (self._is_producer or self._write_behind):
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            params = (new.sampling_params.extra_args or {}).get("kv_transfer_params") if new.sampling_params else None
            if (params or {}).get("prefetch"):  # a migration's target loading blocks ahead: nothing new to save
                continue
            producer = self._prefills(params)
            if producer:  # the whole prompt, its partial last block included
                hashes, saved = block_hashes(self._seeds[new.req_id], prompt, self._block_size, partial=True), \
                    self._reused_blocks.pop(new.req_id, 0)
            elif not self._write_behind:
                continue
            else:  # decode: full blocks beyond what the prefill saved (all, if it prefilled itself) as they fill
                hashes, saved = [], 0 if (params or {}).get("save_prompt") else (len(prompt) - 1) // self._block_size
            self._saves[new.req_id] = _SaveState(hashes=hashes, num_tokens=len(prompt),
                                                 block_ids=list(new.block_ids[0]), saved=saved,
                                                 trace=dict((params or {}).get("trace") or {}), producer=producer)
            self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._saves.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:  # preempted and back: a fresh block list
                    state.block_ids = list(new_ids[0])
                else:
                    state.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: MeshConnectorMetadata, req_id: str, tokens_done: int) -> None:
        state = self._saves[req_id]
        if state.producer:
            ready = len(state.hashes) if tokens_done >= state.num_tokens else tokens_done // self._block_size
        else:
            request = self._requests.get(req_id)
            # With async scheduling the newest token may not be known yet: hash what is.
            known = min(tokens_done, len(request.all_token_ids)) if request is not None else 0
            ready = known // self._block_size
            durable = self._durable_tail or bool(self._durable_tails and request is not None
                                                 and _tail_id(request) in self._durable_tails)
            if request is not None and len(state.hashes) < ready and (ready > state.saved or durable):
                state.hashes = block_hashes(self._seed(request), request.all_token_ids[: ready * self._block_size],
                                            self._block_size)
            ready = min(ready, len(state.hashes))
            if durable and known % self._block_size and ready < len(state.block_ids):
                assert request is not None
                parent = state.hashes[ready - 1] if ready else self._seed(request)
                partial = block_hashes(parent, request.all_token_ids[ready * self._block_size : known],
                                       self._block_size, partial=True)
                meta.saves.append(BlockTransfer(req_id, [state.block_ids[ready]], partial, state.trace))
        complete = min(ready, len(state.block_ids))
        if complete > state.saved:
            meta.saves.append(BlockTransfer(req_id, state.block_ids[state.saved:complete],
                                            state.hashes[state.saved:complete], state.trace, wait=state.producer))
            state.saved = complete

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._saves.pop(request.request_id, None)
        exporting = self._plan_export(request, block_ids, state)
        self._durable_tails.discard(_tail_id(request))
        self._requests.pop(request.request_id, None)
        self._seeds.pop(request.request_id, None)
        self._load_plans.pop(request.request_id, None)
        self._reused_blocks.pop(request.request_id, None)
        self._decided.pop(request.request_id, None)
        preemptions = self._preemptions.pop(request.request_id, None)
        extra = {"preemptions": preemptions} if preemptions else {}
        if state is None or not state.producer:
            return exporting, extra or None
        return False, extra | {
            "fingerprint": self._fingerprint,
            "kv_layout": self._layout,
            "block_size": self._block_size,
            "block_hashes": state.hashes[: state.saved],
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        measured = connector_output.kv_connector_worker_meta
        if isinstance(measured, MeshWorkerMetadata):
            self._load_rate.observe(measured.load_bytes, measured.load_s)
            self._prefill_rate.observe(measured.compute_tokens, measured.compute_s)

    def _plan_export(self, request: Request, block_ids: list[int], state: _SaveState | None) -> bool:
        """A decode request stopped (aborted) while it carries a `tail_id`: plan storing its full
        blocks not written yet and its last two blocks as tails (the caller may have seen up to a
        block fewer tokens than the engine computed). True: its blocks stay until that is done."""
        from vllm.v1.request import RequestStatus

        tail_id = _tail_id(request)
        computed = request.num_computed_tokens
        if not (self._is_consumer and tail_id and request.status == RequestStatus.FINISHED_ABORTED and computed
                and block_ids):
            return False
        size = self._block_size
        full = min(computed, len(request.all_token_ids)) // size
        # without write-behind, what decode found stored when it started: all but its last prompt token
        saved = state.saved if state is not None else (len(request.prompt_token_ids or []) - 1) // size
        hashes = block_hashes(self._seed(request), request.all_token_ids[: full * size], size)[saved:]
        ids = block_ids[saved : saved + len(hashes)]
        last = min((computed - 1) // size, len(block_ids) - 1)
        for index in range(max(last - 1, 0), last + 1):
            ids.append(block_ids[index])
            hashes.append(tail_hash(tail_id, index))
        self._planned_exports.append(BlockTransfer(request.request_id, ids, hashes, request_trace(request)))
        return True

    # ==== worker side ======================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks, heads = self._kv_cache_config.num_blocks, sum(s.count for s in self._slices)
        for name, cache in kv_caches.items():
            if cache.dim() < 3 or cache.shape[0] != num_blocks or cache.shape[1] != heads:
                raise RuntimeError(f"{name}: expected [blocks ({num_blocks}), this rank's KV heads ({heads}), ...], "
                                   f"got shape {tuple(cache.shape)}")
        self._kv_caches = dict(sorted(kv_caches.items(), key=lambda kv: _layer_index(kv[0])))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_started = time.perf_counter()  # the forward follows

    def _meta(self) -> MeshConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MeshConnectorMetadata)
        return meta

    def _layer_keys(self, hashes: Sequence[str], layer: int) -> list[str]:
        """This rank's chunks of `hashes` in one layer: block by block, head group by head group."""
        return [chunk_key(h, layer, s.group) for h in hashes for s in self._slices]

    def _gather(self, cache: torch.Tensor, block_ids: list[int], views: list[memoryview]) -> None:
        """Copy blocks of one layer's cache into byte buffers, one a chunk (`_layer_keys`' order)."""
        chunks = iter(views)
        for block_id in block_ids:
            for s in self._slices:
                source = cache[block_id, s.start : s.start + s.count]
                torch.frombuffer(next(chunks), dtype=cache.dtype).view(source.shape).copy_(source)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._kv is not None
        for transfer in self._meta().exports:
            self._export(transfer)
        for transfer in self._meta().loads:
            parent = telemetry.extract(transfer.trace)
            span = self._tracer.start_span("kv.load", context=parent, attributes={
                "kv.blocks": len(transfer.block_ids), "kv.layers": len(self._kv_caches), "request.id": transfer.req_id})
            if transfer.last_block_tokens and not self._async_load:
                # The engine writes this step's new tokens into the partial last block before
                # `wait_for_layer_load` runs, so that block must be in place before the forward.
                head = BlockTransfer(transfer.req_id, transfer.block_ids[-1:], transfer.hashes[-1:], transfer.trace)
                self._load_now(head, parent)
                transfer = BlockTransfer(transfer.req_id, transfer.block_ids[:-1], transfer.hashes[:-1], transfer.trace)
            self._loads[transfer.req_id] = self._start_fetch(transfer, parent, span)

    def _start_fetch(self, transfer: BlockTransfer, parent: Any, span: Any) -> _PendingLoad:
        """Request every layer of `transfer` at once; the answers arrive while layers compute."""
        assert self._kv is not None
        futures = {
            name: self._kv.get(self._layer_keys(transfer.hashes, _layer_index(name)),
                               partial(self._copy_in, self._kv_caches[name], transfer.block_ids), trace_context=parent)
            for name in self._kv_caches
        } if transfer.block_ids else {}
        load = _PendingLoad(transfer, futures, span)
        for future in futures.values():
            future.add_done_callback(lambda _: setattr(load, "last_arrival", time.perf_counter()))
        return load

    def _copy_in(self, cache: torch.Tensor, block_ids: list[int], values: Sequence[memoryview | None]) -> list[int]:
        """Copy fetched chunks (`_layer_keys`' order) into their cache slots (in the transfer thread,
        so layer i+1 lands while layer i computes); returns the block ids that could not be loaded."""
        missing, per_block = [], len(self._slices)
        for i, block_id in enumerate(block_ids):
            for s, value in zip(self._slices, values[i * per_block : (i + 1) * per_block]):
                target = cache[block_id, s.start : s.start + s.count]
                if value is None or len(value) != target.numel() * cache.element_size():
                    missing.append(block_id)
                    break
                target.copy_(torch.frombuffer(value, dtype=cache.dtype).view(target.shape))
        return missing

    def _load_now(self, transfer: BlockTransfer, parent: Any) -> None:
        """Load `transfer`'s blocks of every layer before the forward, in one fetch."""
        assert self._kv is not None
        names, count = list(self._kv_caches), len(transfer.hashes) * len(self._slices)

        def copy_in(values: Sequence[memoryview | None]) -> list[int]:
            return [block for i, name in enumerate(names) for block in
                    self._copy_in(self._kv_caches[name], transfer.block_ids, values[i * count : (i + 1) * count])]

        keys = [key for name in names for key in self._layer_keys(transfer.hashes, _layer_index(name))]
        try:
            missing = self._kv.get(keys, copy_in, trace_context=parent).result(timeout=self._timeout_s)
        except Exception as exc:  # the store is down or slow: recompute instead
            log.warning("request %s: loading its last block failed: %s", transfer.req_id, exc)
            missing = transfer.block_ids
        self._load_errors.update(missing)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._async_load:
            return
        for req_id, load in list(self._loads.items()):
            self._finish_layer(load, layer_name)
            if not load.futures:
                self._end_load(req_id)

    def _finish_layer(self, load: _PendingLoad, layer_name: str) -> None:
        future = load.futures.pop(layer_name, None)
        if future is None:
            return
        try:
            missing = future.result(timeout=self._timeout_s)
        except Exception as exc:  # the store is down or slow: recompute instead
            log.warning("request %s: loading %s failed: %s", load.transfer.req_id, layer_name, exc)
            missing = load.transfer.block_ids
        if missing:
            load.failed = True
            self._load_errors.update(missing)

    def _end_load(self, req_id: str) -> None:
        load = self._loads.pop(req_id)
        if not load.failed and load.last_arrival:
            self._measured.load_bytes += len(load.transfer.block_ids) * self._block_bytes
            self._measured.load_s += load.last_arrival - load.started
        load.span.set_attribute("kv.failed", load.failed)
        load.span.end()
        if self._async_load:
            self._finished_loads.add(req_id)

    def _export(self, transfer: BlockTransfer) -> None:
        """Copy a stopped request's blocks out and put them (not waited for: its blocks are freed
        once copied; whoever needs them waits for the keys in the store)."""
        for name, cache in self._kv_caches.items():
            self._put_copies(cache, transfer, _layer_index(name), pin_s=self._pin_s)
        self._exported.add(transfer.req_id)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._kv is not None
        layer = _layer_index(layer_name)
        for transfer in self._meta().saves:
            if transfer.wait:
                # The step waits for these puts (`wait_for_save`), so the blocks stay as they are:
                # the transfer thread gathers them straight into the buffers they are sent from.
                keys = self._layer_keys(transfer.hashes, layer)
                chunk_bytes = kv_layer[0, : self._slices[0].count].numel() * kv_layer.element_size()
                guard = FillGuard()
                future = self._kv.put_filled(keys, [chunk_bytes] * len(keys),
                                             guard.guarded(partial(self._gather, kv_layer, transfer.block_ids)),
                                             pin_s=self._pin_s, trace_context=telemetry.extract(transfer.trace))
                self._pending_puts.append((future, guard, transfer.req_id))
            else:  # write-behind is not waited for: copy the blocks now, they may be reused later
                self._put_copies(kv_layer, transfer, layer, pin_s=0.0)

    def _put_copies(self, cache: torch.Tensor, transfer: BlockTransfer, layer: int, pin_s: float) -> None:
        """Copy `transfer`'s blocks of one layer out of `cache` and put them without waiting (the
        puts are reaped later), so the blocks may be reused or freed at once."""
        assert self._kv is not None
        ids = torch.tensor(transfer.block_ids, dtype=torch.long, device=cache.device)
        blocks = cache[ids].cpu()
        groups = [blocks[:, s.start : s.start + s.count].contiguous().view(torch.uint8).reshape(len(ids), -1).numpy()
                  for s in self._slices]
        rows = [group[i] for i in range(len(ids)) for group in groups]  # `_layer_keys`' order
        future = self._kv.put(self._layer_keys(transfer.hashes, layer), rows, pin_s=pin_s,
                              trace_context=telemetry.extract(transfer.trace))
        self._write_behind_puts.append((future, transfer.req_id))

    def wait_for_save(self) -> None:
        """Prefill: the step ends once its KV is stored (decode may load it next). Decode's
        write-behind is not waited for: its blocks were copied out, so it only gets reaped."""
        self._reap_write_behind()
        meta = self._meta() if self.has_connector_metadata() else None
        if meta is not None and not meta.loads and meta.step_tokens >= PREFILL_SAMPLE_TOKENS and self._step_started:
            self._measured.compute_tokens, self._measured.compute_s = meta.step_tokens, \
                time.perf_counter() - self._step_started
        if not self._pending_puts:
            return
        started_ns = time.time_ns()
        for future, guard, req_id in self._pending_puts:
            try:
                future.result(timeout=self._timeout_s)
            except Exception as exc:  # the decode side will miss and recompute
                guard.revoke()  # its blocks may be reused once the step ends: a late copy would store those
                log.warning("request %s: saving KV failed: %s", req_id, exc)
        self._pending_puts.clear()
        if meta is not None:
            for transfer in meta.saves:
                with self._tracer.start_as_current_span("kv.save_wait", context=telemetry.extract(transfer.trace),
                                                        start_time=started_ns) as span:
                    span.set_attribute("kv.blocks", len(transfer.block_ids))

    def _reap_write_behind(self) -> None:
        pending = []
        for future, req_id in self._write_behind_puts:
            if not future.done():
                pending.append((future, req_id))
            elif future.exception() is not None:
                log.warning("request %s: writing generated KV back failed: %s", req_id, future.exception())
        self._write_behind_puts = pending

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._async_load:
            for req_id, load in list(self._loads.items()):
                for name, future in list(load.futures.items()):
                    if future.done():
                        self._finish_layer(load, name)
                if not load.futures:
                    self._end_load(req_id)
        done, self._finished_loads = self._finished_loads, set()
        sent, self._exported = self._exported, set()
        return (sent or None), (done or None)

    def build_connector_worker_meta(self) -> MeshWorkerMetadata | None:
        measured, self._measured = self._measured, MeshWorkerMetadata()
        return measured if measured.load_s or measured.compute_s else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for client in (self._kv, self._lookup):
            if client is not None:
                client.close()
        self._kv = self._lookup = None
