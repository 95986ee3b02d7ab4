"""Run a prefill worker: `python -m llmesh_prefill` (settings: llmesh.wire.config.WorkerSettings)."""

from llmesh.engine.worker import run_worker
from llmesh_sim import start_modelled_engine


def handlers(worker):
    from .service import PrefillService  # after `run_worker` set the engine's OpenMP threads: it loads torch

    return {worker.subject: PrefillService(worker).prefill}


if __name__ == "__main__":
    run_worker("prefill", handlers, start_modelled_engine)
