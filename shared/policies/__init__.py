"""Scheduling and placement policies: pure, deterministic functions over snapshots.

No I/O and no clock reads: the caller passes `now` and a seeded random source, so the
router, the placement service and any simulator call the same code and tests are tables.
"""

from llmesh.policies.load import WorkerSnapshot, least_loaded

POLICIES = {"least_loaded": least_loaded}
NEEDS_PREDICTION: set[str] = set()  # policies that read a request's predicted output length

__all__ = ["NEEDS_PREDICTION", "POLICIES", "WorkerSnapshot", "least_loaded"]
