"""Scheduling and placement policies: pure, deterministic functions over snapshots.

No I/O and no clock reads: the caller passes `now` and a seeded random source, so the
router, the placement service and any simulator call the same code and tests are tables.
`make_policy(name, params)` builds a dispatch policy by its registered name; each factory's
keyword arguments are its parameters (settings: `MESH_POLICY`, `MESH_POLICY_PARAMS`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from llmesh.policies.ascendra import ascendra
from llmesh.policies.banaserve import banaserve, banaserve_queue
from llmesh.policies.baseline import least_loaded, power_of_two, random_choice, round_robin
from llmesh.policies.core import DispatchContext, Policy, RequestView, WorkerView
from llmesh.policies.llumnix import llumnix
from llmesh.policies.prefix import PrefixIndex, cache_aware
from llmesh.policies.queueing import (
    QueuePolicy,
    edf,
    fairness,
    fcfs,
    priority_fcfs,
    prism,
    prism_refuse,
    slo_odbs,
)

POLICIES: dict[str, Callable[..., Policy]] = {
    "round_robin": round_robin,
    "random": random_choice,
    "least_loaded": least_loaded,
    "power_of_two": power_of_two,
    "cache_aware": cache_aware,
    "banaserve": banaserve,
    "banaserve_queue": banaserve_queue,
    "llumnix": llumnix,
    "ascendra": ascendra,
}


QUEUE_POLICIES: dict[str, Callable[..., QueuePolicy]] = {
    "fcfs": fcfs,
    "priority": priority_fcfs,
    "edf": edf,
    "prism": prism,
    "prism-refuse": prism_refuse,
    "slo_odbs": slo_odbs,
    "fairness": fairness,
}


def make_policy(name: str, params: Mapping[str, float] | None = None) -> Policy:
    """The dispatch policy registered as `name`, with `params`; ValueError naming what is wrong otherwise."""
    return _make(POLICIES, "policy", name, params)


def make_queue_policy(name: str, params: Mapping[str, float] | None = None) -> QueuePolicy:
    """The queue policy registered as `name`, with `params`; ValueError naming what is wrong otherwise."""
    return _make(QUEUE_POLICIES, "queue policy", name, params)


def _make(registry: Mapping[str, Callable[..., Any]], kind: str, name: str, params: Mapping[str, float] | None) -> Any:
    factory = registry.get(name)
    if factory is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(registry)}")
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(params or {}) - set(accepted))
    if unknown:
        raise ValueError(
            f"{kind} {name!r} has no parameter {', '.join(unknown)}; it takes: {', '.join(accepted) or 'none'}"
        )
    return factory(**(params or {}))


__all__ = [
    "POLICIES",
    "QUEUE_POLICIES",
    "DispatchContext",
    "Policy",
    "PrefixIndex",
    "QueuePolicy",
    "RequestView",
    "WorkerView",
    "make_policy",
    "make_queue_policy",
]
