"""Cache-aware prefix affinity: the baseline that chases cache locality (vllm-router's
`cache_aware` policy, llm-d's prefix-cache scorer), for comparison with the mesh's global KV
store, where every worker finds every stored prefix and routing need not chase it.

The caller keeps a `PrefixIndex`: for each worker, the prompt blocks (chained hashes, so equal
hashes mean equal prefixes) it was sent, least recently used dropped past a capacity, as
vllm-router keeps an approximate radix tree of what it routed where. Before a dispatch it puts
each worker's match, in leading blocks, into `DispatchContext.cached_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from llmesh.policies.core import DispatchContext, Policy, WorkerView, lowest_cost, request_load


class PrefixIndex:
    """Which prompt blocks each worker was sent: deterministic, bounded, no I/O."""

    def __init__(self, capacity_blocks: int = 1 << 16):
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def matched(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` `worker_id` holds."""
        held = self._blocks.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def matches(self, worker_ids: Sequence[str], hashes: Sequence[int]) -> dict[str, int]:
        return {w: self.matched(w, hashes) for w in worker_ids} if hashes else {}

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        """`worker_id` computed (or was sent) these blocks: most recently used now."""
        held = self._blocks.setdefault(worker_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)


def cache_aware(
    cache_threshold: float = 0.5, balance_abs_threshold: float = 32, balance_rel_threshold: float = 1.1
) -> Policy:
    """vllm-router's `cache_aware` (its defaults): while the load is balanced, the worker holding
    the longest prefix of the prompt if that covers more than `cache_threshold` of its blocks,
    else the least loaded; once the most and least loaded workers differ by more than
    `balance_abs_threshold` requests and `balance_rel_threshold` times, the least loaded."""
    if not 0 <= cache_threshold <= 1:
        raise ValueError(f"cache_aware: cache_threshold must lie in [0, 1], not {cache_threshold}")

    def pick(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
        if not scored:
            return None
        held = [w.running + w.assigned for w, _ in scored]
        imbalanced = max(held) - min(held) > balance_abs_threshold and max(held) > balance_rel_threshold * min(held)
        blocks = len(ctx.request.prefix_hashes)
        if not imbalanced and blocks:
            best = max(ctx.cached_blocks.get(w.worker_id, 0) for w, _ in scored)
            if best / blocks > cache_threshold:
                return lowest_cost(ctx, [(w, c) for w, c in scored if ctx.cached_blocks.get(w.worker_id, 0) == best])
        return lowest_cost(ctx, scored)

    return Policy(
        "cache_aware",
        costs=((1.0, request_load),),
        picker=pick,
        needs_prefix=True,
        params={
            "cache_threshold": cache_threshold,
            "balance_abs_threshold": balance_abs_threshold,
            "balance_rel_threshold": balance_rel_threshold,
        },
    )
