"""Scheduling and placement policies: pure, deterministic functions over snapshots.

No I/O and no clock reads: the caller passes `now` and a seeded random source, so the
router, the placement service and any simulator call the same code and tests are tables.
"""

from llmesh.policies.load import WorkerSnapshot, least_loaded

POLICIES = {"least_loaded": least_loaded}

__all__ = ["POLICIES", "WorkerSnapshot", "least_loaded"]
