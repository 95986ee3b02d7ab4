"""Run a decode worker: `python -m llmesh_decode` (settings: llmesh.config.WorkerSettings)."""

from llmesh.worker import run_worker

from .service import DecodeService

if __name__ == "__main__":
    run_worker("decode", lambda worker: DecodeService(worker).handlers())
