"""What the policies see of a worker, built from its heartbeat: one conversion for the router, the
placement service and the simulator, so all three judge a worker by the same numbers.

The view takes every heartbeat field it names, by name: a field added to both reaches the policies
with no copy written by hand; one added to the heartbeat alone must be listed in `HEARTBEAT_ONLY`
(tests/unit/test_views.py fails until it is one or the other).
"""

from __future__ import annotations

from dataclasses import fields, replace

from llmesh.policies.core import WorkerView
from llmesh.wire.messages import WorkerInfo

# heartbeat fields no worker-level policy reads: the engine's context limit, the heartbeat period, preemption
# counts, and where it runs and what it holds (placement's model placement reads those: llmesh_placement.models),
# and the LoRA adapters it serves (the router's catalogue of them: llmesh_router.registry)
HEARTBEAT_ONLY = frozenset(
    {"max_model_len", "heartbeat_s", "preemptions", "host", "memory_bytes", "weights_bytes", "adapters"}
)
VIEWED = tuple(f.name for f in fields(WorkerView) if f.name in WorkerInfo.model_fields)


def worker_view(info: WorkerInfo) -> WorkerView:
    """The policies' snapshot of `info` (nothing sent to the worker since counted)."""
    values = {name: getattr(info, name) for name in VIEWED}
    values["requests"], values["roles"] = tuple(info.requests), tuple(info.roles)
    values["loaded_adapters"] = frozenset(info.loaded_adapters)
    return WorkerView(**values)


def since_heartbeat(
    view: WorkerView, assigned: int, released: int, assigned_blocks: int = 0, sent_backlog: int = 0
) -> WorkerView:
    """A worker's heartbeat `view` with a dispatcher's own account since: the requests it `assigned` there
    (and the KV blocks their prompts need), those it saw finish there (`released`), and the prompt tokens
    it sent that are not computed yet."""
    if not assigned and not released and not sent_backlog:
        return view
    from_assigned = min(released, assigned)  # a finished request was either sent since the heartbeat or in it
    return replace(
        view,
        assigned=assigned - from_assigned,
        assigned_blocks=assigned_blocks,
        running=max(view.running - (released - from_assigned), 0),
        sent_backlog=sent_backlog,
    )
