"""BanaServe's load-aware dispatch (Algorithm 4-2).

Each instance's utilisation is U = C/Cmax + M/Mmax: its compute load (requests held or on
their way, against the requests it runs at once) plus its KV memory load (blocks in use,
against its blocks). A request goes to the instance with the lowest U if that is under the
threshold θ; otherwise it waits in the global queue until one is.
"""

from __future__ import annotations

from llmesh.policies.core import DispatchContext, Policy, WorkerView, lowest_cost_below


def utilisation(ctx: DispatchContext, w: WorkerView) -> float:
    """U = C/Cmax + M/Mmax (the memory term is 0 for a worker that does not report its KV blocks)."""
    return w.load + w.kv_usage


def banaserve(threshold: float = 1.6) -> Policy:
    """The lowest U under `threshold` (0 < θ ≤ 2: both terms are fractions), else the request waits."""
    if not 0 < threshold <= 2:
        raise ValueError(f"banaserve: threshold must lie in (0, 2], not {threshold}")
    return Policy("banaserve", costs=((1.0, utilisation),), picker=lowest_cost_below(threshold),
                  params={"threshold": threshold})
