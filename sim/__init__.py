"""A GPU-free simulator that drives the production policies (llmesh.policies) on traces."""

from typing import Any


def start_modelled_engine(args: Any, settings: Any, worker_id: str) -> Any:
    """A worker's modelled engine (llmesh.engine.worker.ModelledEngineStart), imported only when one is asked for:
    its imports (numpy) must not load before the worker has set its engine's OpenMP threads."""
    from .modelled_engine import ModelledEngine

    return ModelledEngine.start(args, settings, worker_id)
