"""The connector's scheduler side (vLLM's scheduler process): which tokens a request finds in the
kv-store, which blocks each step loads, saves and exports, and how a preempted request resumes.
No tensors and no transfers: it asks the store only whether blocks are there (`Lookup`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from llmesh.engine.resumed import resume_grammar
from llmesh.policies.preemption import RateEstimate, swap_or_recompute
from llmesh.wire.config import ConnectorConfig
from llmesh.wire.errors import InvalidRequest, MeshError
from llmesh.wire.kvkeys import adapter_digest, block_hashes, chain_seed, tail_hash
from llmesh.wire.messages import Ack, DurableTail, Message

from .metadata import BlockTransfer, MeshConnectorMetadata, MeshWorkerMetadata, request_trace, tail_id

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("llmesh.engine.kv_connector")


class Lookup(Protocol):
    def stored_run(self, block_hashes: list[str], layout: dict[str, Any]) -> int:
        """How many of `block_hashes`, from the first, the store holds whole (every layer and head group)."""


@dataclass
class _SaveState:
    """Progress of saving one request's blocks: a prefill's prompt, or a decode's blocks written behind."""

    hashes: list[str]  # the prompt's blocks, the trailing partial one included
    num_tokens: int
    block_ids: list[int]
    saved: int = 0
    trace: dict[str, str] = field(default_factory=dict)
    producer: bool = False  # a prefill's prompt (else a decode's blocks, written behind)


@dataclass
class _RequestState:
    """What this side keeps of one request, from its first sight to `request_finished`."""

    seed: str  # the start of its block-hash chain
    resumed: bool = False  # its grammar was brought past its earlier output
    load: tuple[int, list[str]] | None = None  # planned at matching: tokens computed before, block hashes
    reused_blocks: int = 0  # prefill: leading blocks loaded, so not saved again
    request: Request | None = None  # decode, for write-behind: its token ids grow as it decodes
    save: _SaveState | None = None
    durable: bool = False  # migrating away (`DurableTail`): its tail is written every step
    preemptions: dict[str, int] = field(default_factory=dict)  # choice -> times
    decided: int | None = None  # the preemption its resume was decided for


class ConnectorScheduler:
    """Plans the KV a request loads and saves (see the package's docstring). `producer` / `consumer`:
    vLLM's KV roles of this engine (both: a switchable decode worker)."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        layout: dict[str, Any],
        fingerprint: str,
        block_size: int,
        block_bytes: int,
        producer: bool,
        consumer: bool,
        lookup: Lookup | None,
    ):
        self.config = config
        self._layout, self._fingerprint, self._block_size = layout, fingerprint, block_size
        self._block_bytes = block_bytes  # one block, every layer
        self._is_producer, self._is_consumer = producer, consumer
        self._lookup = lookup
        self._async_load = config.load_mode == "async"
        self._write_behind = consumer and config.write_behind
        self._durable_tail = self._write_behind and config.durable_tail
        # priors until this engine has measured them
        self._load_rate = RateEstimate(config.load_bytes_per_s)
        self._prefill_rate = RateEstimate(config.prefill_tokens_per_s)
        self._requests: dict[str, _RequestState] = {}  # by request id
        self._planned_loads: list[BlockTransfer] = []  # the next step's plans, handed over by build_connector_meta
        self._planned_exports: list[BlockTransfer] = []

    # ---- commands ---------------------------------------------------------------------------------

    async def on_control(self, msg: Message, blob: memoryview) -> Ack:
        """The worker's commands (on the lookup client's thread): `DurableTail` for a migrating request."""
        if not isinstance(msg, DurableTail):
            raise InvalidRequest(f"expected DurableTail, got {type(msg).__name__}")
        named = [s for s in list(self._requests.values()) if s.request and tail_id(s.request) == msg.tail_id]
        if msg.on and not named:
            raise InvalidRequest(f"no request with tail id {msg.tail_id} is decoding here")
        for state in named:
            state.durable = msg.on
        return Ack()

    @property
    def serves_control(self) -> bool:
        """Whether the worker's `DurableTail` commands mean anything here."""
        return self._write_behind and bool(self.config.control_subject)

    # ---- matching -----------------------------------------------------------------------------------

    def _state(self, request: Request) -> _RequestState:
        """The request's record, made on first sight with its chain seed: the fingerprint, its cache
        salt and its LoRA adapter's content."""
        state = self._requests.get(request.request_id)
        if state is None:
            lora = request.lora_request
            adapter = adapter_digest(lora.lora_path) if lora is not None else None
            seed = chain_seed(self._fingerprint, request.cache_salt, adapter)
            state = self._requests[request.request_id] = _RequestState(seed)
        return state

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)  # build_connector_meta sees only the request's scheduling data
        if not state.resumed:  # vLLM asks before the request's first step (and may ask again)
            state.resumed = True
            resume_grammar(request)  # the one scheduler-side hook a request passes before it runs
        if request.skip_reading_prefix_cache:  # it asks for prompt logprobs: vLLM computes its whole prompt
            return 0, False
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

    def _after_preemption(
        self, request: Request, num_computed_tokens: int, matched: tuple[int, bool]
    ) -> tuple[int, bool]:
        """A preempted request resumes: load its stored KV (swap) or let vLLM compute it (recompute)."""
        tokens = matched[0]
        if not tokens:
            return matched
        size = self._block_size
        blocks = -(-(num_computed_tokens + tokens) // size) - num_computed_tokens // size
        cost = swap_or_recompute(
            tokens, blocks * self._block_bytes, self._load_rate.per_s, self._prefill_rate.per_s, self.config.preemption
        )
        state = self._state(request)
        if state.decided != request.num_preemptions:  # asked again while it waits
            state.decided = request.num_preemptions
            state.preemptions[cost.choice] = state.preemptions.get(cost.choice, 0) + 1
            log.info(
                "request %s resumes after preemption %d: %s %d tokens (%d blocks; load ~%.1f ms at %.0f MB/s, "
                "recompute ~%.1f ms at %.0f tokens/s)",
                request.request_id,
                request.num_preemptions,
                cost.choice,
                tokens,
                blocks,
                cost.swap_s * 1e3,
                self._load_rate.per_s / 1e6,
                cost.recompute_s * 1e3,
                self._prefill_rate.per_s,
            )
        if cost.choice == "recompute":
            state.load = None
            return 0, False
        return matched

    def _match_handle(self, request: Request, params: dict[str, Any], num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: the blocks of all but the last token that the request's KV handle lists, then
        those of the rest the store holds."""
        if params.get("fingerprint", self._fingerprint) != self._fingerprint:
            log.error(
                "request %s: KV fingerprint %s does not match ours %s; recomputing",
                request.request_id,
                params.get("fingerprint"),
                self._fingerprint,
            )
            return 0, False
        # vLLM must compute at least the last token itself (after a preemption: all it generated too).
        loadable = request.all_token_ids[:-1]
        ours = block_hashes(self._state(request).seed, loadable, self._block_size, partial=True)
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
            return self._lookup.stored_run(hashes, self._layout)
        except MeshError as exc:
            log.warning("request %s: KV lookup failed (%s); computing it", request.request_id, exc)
            return 0

    def _match_stored_prefix(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prefill: the prompt's leading full blocks that any instance already stored (every
        layer of them): loaded instead of recomputed."""
        state = self._state(request)
        hashes = block_hashes(state.seed, (request.prompt_token_ids or [])[:-1], self._block_size)
        first = num_computed_tokens // self._block_size
        if first >= len(hashes):
            return 0, False
        matched = state.reused_blocks = first + self._stored_run(request, hashes[first:])
        return self._plan_load(request, hashes, matched * self._block_size, num_computed_tokens)

    def _plan_load(
        self, request: Request, hashes: list[str], loadable_tokens: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        new_tokens = loadable_tokens - num_computed_tokens
        if new_tokens <= 0:
            return 0, False
        self._state(request).load = (num_computed_tokens, hashes)
        return new_tokens, self._async_load

    # ---- planning a step ------------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        if self._write_behind:
            state.request = request
        plan, state.load = state.load, None
        if num_external_tokens == 0 or plan is None:
            return
        computed, hashes = plan
        first = computed // self._block_size
        last = -(-(computed + num_external_tokens) // self._block_size)  # a partial last block too
        block_ids = blocks.get_block_ids()[0]
        self._planned_loads.append(
            BlockTransfer(
                request.request_id,
                list(block_ids[first:last]),
                list(hashes[first:last]),
                request_trace(request),
                (computed + num_external_tokens) % self._block_size,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MeshConnectorMetadata:
        meta = MeshConnectorMetadata(
            loads=self._planned_loads,
            exports=self._planned_exports,
            step_tokens=scheduler_output.total_num_scheduled_tokens,
        )
        self._planned_loads, self._planned_exports = [], []
        if not (self._is_producer or self._write_behind):
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            params = (new.sampling_params.extra_args or {}).get("kv_transfer_params") if new.sampling_params else None
            if (params or {}).get("prefetch"):  # a migration's target loading blocks ahead: nothing new to save
                continue
            producer = self._prefills(params)
            if not (producer or self._write_behind):
                continue
            state = self._requests[new.req_id]
            if producer:  # the whole prompt, its partial last block included
                hashes, saved = block_hashes(state.seed, prompt, self._block_size, partial=True), state.reused_blocks
            else:  # decode: full blocks beyond what the prefill saved (all, if it prefilled itself) as they fill
                hashes, saved = [], 0 if (params or {}).get("save_prompt") else (len(prompt) - 1) // self._block_size
            state.save = _SaveState(
                hashes=hashes,
                num_tokens=len(prompt),
                block_ids=list(new.block_ids[0]),
                saved=saved,
                trace=dict((params or {}).get("trace") or {}),
                producer=producer,
            )
            self._plan_save(
                meta, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id]
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            save = self._requests[req_id].save if req_id in self._requests else None
            if save is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:  # preempted and back: a fresh block list
                    save.block_ids = list(new_ids[0])
                else:
                    save.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return meta

    def _plan_save(self, meta: MeshConnectorMetadata, req_id: str, tokens_done: int) -> None:
        state = self._requests[req_id]
        save, request = state.save, state.request
        assert save is not None
        if save.producer:
            ready = len(save.hashes) if tokens_done >= save.num_tokens else tokens_done // self._block_size
        else:
            # With async scheduling the newest token may not be known yet: hash what is.
            known = min(tokens_done, len(request.all_token_ids)) if request is not None else 0
            ready = known // self._block_size
            durable = self._durable_tail or state.durable
            if request is not None and len(save.hashes) < ready and (ready > save.saved or durable):
                save.hashes = block_hashes(
                    state.seed, request.all_token_ids[: ready * self._block_size], self._block_size
                )
            ready = min(ready, len(save.hashes))
            if durable and known % self._block_size and ready < len(save.block_ids):
                assert request is not None
                parent = save.hashes[ready - 1] if ready else state.seed
                partial = block_hashes(
                    parent, request.all_token_ids[ready * self._block_size : known], self._block_size, partial=True
                )
                meta.saves.append(BlockTransfer(req_id, [save.block_ids[ready]], partial, save.trace))
        complete = min(ready, len(save.block_ids))
        if complete > save.saved:
            meta.saves.append(
                BlockTransfer(
                    req_id,
                    save.block_ids[save.saved : complete],
                    save.hashes[save.saved : complete],
                    save.trace,
                    wait=save.producer,
                )
            )
            save.saved = complete

    # ---- a request's end -------------------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        exporting = self._plan_export(request, block_ids)
        state = self._requests.pop(request.request_id, None)  # the one place a record is dropped
        if state is None:
            return exporting, None
        extra = {"preemptions": state.preemptions} if state.preemptions else {}
        if state.save is None or not state.save.producer:
            return exporting, extra or None
        return False, extra | {
            "fingerprint": self._fingerprint,
            "kv_layout": self._layout,
            "block_size": self._block_size,
            "block_hashes": state.save.hashes[: state.save.saved],
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        measured = connector_output.kv_connector_worker_meta
        if isinstance(measured, MeshWorkerMetadata):
            self._load_rate.observe(measured.load_bytes, measured.load_s)
            self._prefill_rate.observe(measured.compute_tokens, measured.compute_s)

    def _plan_export(self, request: Request, block_ids: list[int]) -> bool:
        """A decode request stopped (aborted) while it carries a `tail_id`: plan storing its full
        blocks not written yet and its last two blocks as tails (the caller may have seen up to a
        block fewer tokens than the engine computed). True: its blocks stay until that is done."""
        from vllm.v1.request import RequestStatus

        tail = tail_id(request)
        computed = request.num_computed_tokens
        if not (
            self._is_consumer and tail and request.status == RequestStatus.FINISHED_ABORTED and computed and block_ids
        ):
            return False
        size = self._block_size
        state = self._state(request)
        full = min(computed, len(request.all_token_ids)) // size
        # without write-behind, what decode found stored when it started: all but its last prompt token
        saved = state.save.saved if state.save is not None else (len(request.prompt_token_ids or []) - 1) // size
        hashes = block_hashes(state.seed, request.all_token_ids[: full * size], size)[saved:]
        ids = block_ids[saved : saved + len(hashes)]
        last = min((computed - 1) // size, len(block_ids) - 1)
        for index in range(max(last - 1, 0), last + 1):
            ids.append(block_ids[index])
            hashes.append(tail_hash(tail, index))
        self._planned_exports.append(BlockTransfer(request.request_id, ids, hashes, request_trace(request)))
        return True
