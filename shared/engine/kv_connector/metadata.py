"""What the connector's two sides share: the per-step plan the scheduler side sends the worker side,
what the worker side measures back, and the names of what they move."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from llmesh.wire.kvkeys import chunk_key, rank_first_head, rank_heads

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
        return MeshWorkerMetadata(
            self.load_bytes + other.load_bytes,
            self.load_s + other.load_s,
            max(self.compute_tokens, other.compute_tokens),
            max(self.compute_s, other.compute_s),
        )


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
    return [
        HeadSlice((first + start) // per, start, per)
        for start in range(0, rank_heads(total, tensor_parallel_size), per)
    ]


def layer_keys(hashes: list[str], layer: int, slices: list[HeadSlice]) -> list[str]:
    """A rank's chunks of `hashes` in one layer, block by block, head group by head group: the order
    of a layer's bytes on the host (`llmesh.engine.kv_mover`)."""
    return [chunk_key(h, layer, s.group) for h in hashes for s in slices]


def layer_index(name: str) -> int:
    """The (global) layer number in a vLLM layer name such as `model.layers.3.self_attn.attn`."""
    match = re.search(r"\.(\d+)\.", name)
    return int(match.group(1)) if match else 0


def tail_id(request: Any) -> str | None:
    """The id a decode worker named the request's exported blocks by (`kvkeys.tail_hash`), if any."""
    return (getattr(request, "kv_transfer_params", None) or {}).get("tail_id")


def request_trace(request: Any) -> dict[str, str]:
    params = getattr(request, "kv_transfer_params", None) or {}
    return dict(params.get("trace") or {})
