"""A vLLM general plugin (entry point `vllm.general_plugins`), loaded by vLLM in every engine
process: the API process, the EngineCore and each Worker.

It does nothing unless `MESH_ENGINE_SPIN_S` is set, which the mesh's workers set from their
settings (so a plain vLLM server in the same environment runs as shipped):

- `MESH_ENGINE_SPIN_S`: how long an engine's processes busy-wait (`sched_yield` in a loop) for
  the next message between its scheduler and its model executor before sleeping on a socket.
  vLLM hard-codes 1 s, so an active engine keeps two processes (EngineCore and Worker) at
  100% CPU; fine with cores to spare, but on a host with about one core per engine the
  spinning steals the core from the compute and from every other service. 0 sleeps at once (a
  wake-up costs tens of microseconds per step).
"""

from __future__ import annotations

import os


def register() -> None:
    spin = os.environ.get("MESH_ENGINE_SPIN_S")
    if not spin:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    seconds = float(spin)
    # A data descriptor on the class wins over the instance attribute vLLM sets in __init__, so
    # queues made before this plugin loaded obey it too.
    shm_broadcast.SpinCondition.busy_loop_s = property(lambda self: seconds, lambda self, value: None)
