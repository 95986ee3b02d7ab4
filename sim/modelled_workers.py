"""Several workers with modelled engines in one process, as Dynamo's mocker runs `--num-workers`: for benchmarks
of the control plane over more workers than this machine holds as processes (one takes ~590 MB, vLLM's imports).
Each is the real worker service (`llmesh.engine.worker.EngineWorker` with its role's handlers): its own NATS
connection, heartbeats, id and modelled engine.

    MESH_MODELLED_ENGINE=h100-llama2-7b [settings] python -m llmesh_sim.modelled_workers --role decode --count N

Worker ids are `MESH_WORKER_ID` (default `<role>-modelled-<pid>`) with `-<i>` after it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from llmesh.engine.worker import EngineWorker
from llmesh.wire.config import WorkerSettings
from llmesh.wire.lifecycle import run_service, setup_logging

from . import start_modelled_engine

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--count", type=int, required=True)
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    if not settings.modelled_engine:
        parser.error("MESH_MODELLED_ENGINE names no profile: these workers run modelled engines only")
    setup_logging("modelled-workers", settings.log_level)
    if args.role == "decode":
        from llmesh_decode.__main__ import handlers
    else:
        from llmesh_prefill.__main__ import handlers
    base = settings.worker_id or f"{args.role}-modelled-{os.getpid()}"

    async def run(stop: asyncio.Event) -> None:
        workers: list[EngineWorker] = []
        try:
            for i in range(args.count):
                own = settings.model_copy(update={"worker_id": f"{base}-{i}"})
                worker = await EngineWorker.create(own, args.role, start_modelled_engine)
                await worker.start(handlers(worker))
                workers.append(worker)
            log.info("%d modelled %s workers up", len(workers), args.role)
            await stop.wait()
        finally:
            for worker in workers:
                await worker.close()

    run_service(run)


if __name__ == "__main__":
    main()
