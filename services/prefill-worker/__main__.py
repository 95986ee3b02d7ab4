"""Run a prefill worker: `python -m llmesh_prefill` (settings: llmesh.wire.config.WorkerSettings)."""

from llmesh.engine.worker import run_worker

from .service import PrefillService

if __name__ == "__main__":
    run_worker("prefill", lambda worker: {worker.subject: PrefillService(worker).prefill})
