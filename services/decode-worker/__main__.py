"""Run a decode worker: `python -m llmesh_decode` (settings: llmesh.wire.config.WorkerSettings). With
`MESH_SWITCHABLE=1` it serves prefill too, on the same engine, when placement switches its role."""

from llmesh.engine.worker import run_worker
from llmesh_sim import start_modelled_engine


def handlers(worker):
    # after `run_worker` set the engine's OpenMP threads: these load torch
    from llmesh.wire.messages import Subjects
    from llmesh_prefill.service import PrefillService

    from .service import DecodeService

    served = DecodeService(worker).handlers()
    if "prefill" in worker.roles:
        served[Subjects.worker("prefill", worker.worker_id)] = PrefillService(worker).prefill
    return served


if __name__ == "__main__":
    run_worker("decode", handlers, start_modelled_engine)
