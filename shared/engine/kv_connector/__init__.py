"""The mesh's vLLM KV connector: moves whole KV blocks, layer by layer, through the kv-store.

Loaded by vLLM with `kv_connector="MeshKVConnector"`, `kv_connector_module_path="llmesh.engine.kv_connector"`.
As vLLM's own connectors, it is a facade over two objects with their own state: `ConnectorScheduler`
(scheduler.py: matching, planning loads, saves and exports, preemption choices, the durable tail) in
the scheduler's process, `ConnectorWorker` (worker.py: the transfers, with `llmesh.engine.kv_mover` for the
tensors) in each model process. Both read one validated `llmesh.wire.config.ConnectorConfig`.

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
waiting, each block that generation fills (write-behind: every layer at once after the step's forward,
in `wait_for_save`), so the next turn of a conversation
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
gather/scatter serves CPU and GPU (`llmesh.engine.kv_mover`: on a GPU one indexed copy a layer, copied
out on a copy stream and in on a side stream, ordered by events, to and from pinned or CUDA-registered
host memory; nothing in the forward makes the host wait for the GPU). The hooks inside the forward
(`wait_for_layer_load`, `save_kv_layer`) must run on every step, so the connector asks vLLM for
piecewise CUDA graphs (`requires_piecewise_for_cudagraph`): attention, and the hooks around it, run
eagerly between captured pieces; full graphs would skip them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from llmesh.engine.kv_mover import HostMemory
from llmesh.engine.kvclient import ThreadedKvClient
from llmesh.wire import telemetry
from llmesh.wire.config import ConnectorConfig
from llmesh.wire.kvkeys import fingerprint, kv_layout

from .metadata import BlockTransfer, HeadSlice, MeshConnectorMetadata, MeshWorkerMetadata, rank_slices
from .scheduler import ConnectorScheduler
from .worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "BlockTransfer",
    "ConnectorScheduler",
    "ConnectorWorker",
    "HeadSlice",
    "MeshConnectorMetadata",
    "MeshKVConnector",
    "MeshWorkerMetadata",
    "rank_slices",
]


def _log_to_stderr() -> None:
    """The engine's processes configure only vLLM's loggers: show ours (INFO and up) beside them."""
    root = logging.getLogger("llmesh")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


class MeshKVConnector(KVConnectorBase_V1):
    """vLLM's entry point: hands each call to the side of its role."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_to_stderr()
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        layout = kv_layout(vllm_config)
        block_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(kv_cache_config.num_blocks, 1)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._clients: list[ThreadedKvClient] = []
        if role == KVConnectorRole.SCHEDULER:
            transfer = self._kv_transfer_config
            lookup = None
            if transfer.is_kv_consumer or config.reuse_prefix:
                client = ThreadedKvClient(
                    config.nats_url,
                    f"{config.service_name}-lookup",
                    threads=1,
                    redis_url=config.redis_url,
                    timeout=config.timeout_s,
                )
                self._clients.append(client)
                lookup = client.client
            self._scheduler = ConnectorScheduler(
                config,
                layout=layout,
                fingerprint=fingerprint(layout),
                block_size=vllm_config.cache_config.block_size,
                block_bytes=block_bytes,
                producer=transfer.is_kv_producer,
                consumer=transfer.is_kv_consumer,
                lookup=lookup,
            )
            if self._clients and self._scheduler.serves_control:
                assert config.control_subject is not None  # serves_control says so
                self._clients[0].serve(config.control_subject, self._scheduler.on_control)
        elif role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            from vllm.platforms import current_platform

            tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
            slices = rank_slices(
                layout, tensor_parallel_size, get_tensor_model_parallel_rank() if tensor_parallel_size > 1 else 0
            )
            telemetry.setup_tracing(config.service_name, otlp_endpoint=config.otlp_endpoint, trace_dir=config.trace_dir)
            memory = HostMemory(current_platform.device_type, config.pinned_pool_bytes)
            client = ThreadedKvClient(
                config.nats_url,
                f"{config.service_name}-connector",
                redis_url=config.redis_url,
                timeout=config.timeout_s,
                buffers=memory,
            )
            self._clients.append(client)
            self._worker = ConnectorWorker(
                config,
                slices=slices,
                block_bytes=block_bytes,
                store=client,
                memory=memory,
                tracer=telemetry.tracer("llmesh.engine.kv_connector"),
                trace_context=telemetry.extract,
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # every step's forward calls the layer hooks: no full CUDA graphs

    @property
    def scheduler(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "a scheduler-side call on the worker side"
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        assert self._worker is not None, "a worker-side call on the scheduler side"
        return self._worker

    # ==== scheduler side ===================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MeshConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    # ==== worker side ======================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, MeshConnectorMetadata)
        self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def build_connector_worker_meta(self) -> MeshWorkerMetadata | None:
        return self.worker.build_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            client.close()
