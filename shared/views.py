"""What the policies see of a worker, built from its heartbeat: one conversion for the router and
the placement service, so both judge a worker by the same numbers."""

from __future__ import annotations

from llmesh.messages import WorkerInfo
from llmesh.policies.core import RunningRequest, WorkerView


def worker_view(info: WorkerInfo) -> WorkerView:
    """The policies' snapshot of `info` (nothing sent to the worker since counted)."""
    return WorkerView(
        worker_id=info.worker_id, role=info.role, model=info.model, fingerprint=info.fingerprint,
        capacity=info.capacity, running=info.running, queued_tokens=info.queued_tokens,
        state=info.state, generates=info.generates, kv_blocks_used=info.kv_blocks_used,
        kv_blocks_total=info.kv_blocks_total, block_size=info.block_size,
        prefill_tokens_per_s=info.prefill_tokens_per_s,
        requests=tuple(RunningRequest(r.request_id, r.prompt_tokens, r.generated, r.max_tokens, r.predicted_tokens,
                                      r.priority, r.migrating, r.predicted_remaining, r.remaining_at)
                       for r in info.requests),
        roles=tuple(info.roles))
