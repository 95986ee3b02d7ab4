"""A vLLM general plugin (entry point `vllm.general_plugins`), loaded by vLLM in every engine
process: the API process, the EngineCore and each Worker.

It does nothing unless `MESH_ENGINE_SPIN_S`, `MESH_ENGINE_CORES` or `MESH_ENGINE_RESUMES` is set,
which the mesh's workers set (so a plain vLLM server in the same environment runs as shipped):

- `MESH_ENGINE_CORES`: the cores the engine computes on (`VLLM_CPU_OMP_THREADS_BIND`'s syntax);
  the EngineCore process is kept on them. vLLM binds only the Workers' compute threads, so the
  EngineCore, which busy-waits for each step's result, spun on whichever core was free: on a
  small host a decoding engine took both cores, and every other process (the router, the bus,
  the other engines' services) stalled for seconds. On its workers' cores its `sched_yield`
  gives way to the compute it waits for (the two take turns anyway: a step is scheduled, then
  run). The service's own process stays free to run anywhere.

- `MESH_ENGINE_SPIN_S`: how long an engine's processes busy-wait (`sched_yield` in a loop) for
  the next message between its scheduler and its model executor before sleeping on a socket.
  vLLM hard-codes 1 s, so an active engine keeps two processes (EngineCore and Worker) at
  100% CPU; fine with cores to spare, but on a host with about one core per engine the
  spinning steals the core from the compute and from every other service. It must be above 0:
  with 0, each wait goes straight to vLLM's notice socket, whose notices (dropped past a
  high-water mark of one, conflated on the reader's side) get lost, and a step then waits out a
  5 s poll (measured: 5.0 s a request on the tiny model; 0.001 s of spin, none).

- `MESH_ENGINE_RESUMES`: a seeded request resumed on the engine samples on from where the monolithic
  engine's random stream stands after its earlier output (llmesh.engine.resumed).
"""

from __future__ import annotations

import multiprocessing
import os


def engine_cores(bind: str) -> set[int]:
    """The cores a `VLLM_CPU_OMP_THREADS_BIND` value names ('0-3', '0,2', '0|1': one set per rank);
    empty for 'auto', 'nobind' and the like."""
    cores: set[int] = set()
    for part in bind.replace("|", ",").split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            return set()
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def keep_on(cores: set[int]) -> None:
    """Every thread of this process (and those it starts later) on `cores`."""
    for thread_id in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread_id), cores)
        except OSError:  # a thread that has just ended
            pass


def register() -> None:
    if os.environ.get("MESH_ENGINE_RESUMES"):
        from llmesh.engine.resumed import continue_seeded_streams

        continue_seeded_streams()
    cores = engine_cores(os.environ.get("MESH_ENGINE_CORES", ""))
    if cores and multiprocessing.current_process().name.startswith("EngineCore"):
        keep_on(cores)
    spin = os.environ.get("MESH_ENGINE_SPIN_S")
    if not spin:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    seconds = float(spin)
    # A data descriptor on the class wins over the instance attribute vLLM sets in __init__, so
    # queues made before this plugin loaded obey it too.
    shm_broadcast.SpinCondition.busy_loop_s = property(  # type: ignore[assignment]  # vLLM's float, replaced on purpose
        lambda self: seconds, lambda self, value: None
    )
