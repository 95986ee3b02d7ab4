"""A pre-started worker process: `python -m llmesh.engine.standby`, with the cores its engine will have
(`MESH_CPU_CORES`, empty: vLLM decides) in its environment.

It does, before any model is chosen, what takes a cold worker most of its start (docs/activation-notes.md:
three interpreters importing torch and vLLM, ~95% of it on CPU): sets the OpenMP environment of its
cores, imports torch, transformers, vLLM's engine, executor, CPU worker and model code and the mesh's
worker, and freezes its heap (the forked processes' collections then skip it). Then it writes `ready`
and waits for one command line on stdin, JSON `{"module": "llmesh_decode", "env": {...}}`: it takes the
environment and runs the module as `python -m` would, so it becomes that worker; its engine's
processes are forked from it (`prepared`), inheriting the imports, instead of spawned afresh. End of
input without a command: it exits.

It prepares at idle priority (SCHED_IDLE: it runs only on CPU nothing else wants) and takes the normal
policy back when it becomes a worker, so that refilling a host's pool under load does not take the
cores from the engines serving it (a standby's ~20 s of imports held up a 2-core host's queues for
longer than its load lasted). Only where this process may take the normal policy back (root, or a
RLIMIT_NICE that allows nice 0): otherwise it prepares at normal priority.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from llmesh.engine.vllm_plugin import engine_cores, keep_on
from llmesh.wire.config import WorkerSettings

log = logging.getLogger(__name__)
_prepared = False
_service_cores: set[int] = set()  # this process's cores before torch loaded (OMP_PROC_BIND binds it to the engine's)


def prepared() -> bool:
    """Whether this process was pre-started: its engine's processes are to be forked from it."""
    return _prepared


def omp_env(cores: str) -> dict[str, str]:
    """What vLLM sets for a CPU Worker's OpenMP runtime before it starts one (`configure_omp_envs` in
    vllm/utils/ompmultiprocessing.py, its branch without an LD_PRELOADed OpenMP). The runtime reads it
    once, when torch loads it, so a forked Worker must inherit it from the process that imported torch."""
    ids = sorted(engine_cores(cores))
    return {
        "OMP_NUM_THREADS": str(len(ids)),
        "OMP_PLACES": "{" + ",".join(map(str, ids)) + "}",
        "OMP_PROC_BIND": "true",
    }


def idle_priority() -> bool:
    """Put this thread at idle priority if it may return to the normal policy (`normal_priority`)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        return False
    if not normal_priority():
        print("standby: not allowed back from idle priority (RLIMIT_NICE): preparing at normal priority", flush=True)
        return False
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return True


def normal_priority() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def prepare(cores: str) -> None:
    """Everything a worker does before its model matters. No threads: the engine's processes are forked."""
    global _prepared, _service_cores
    _service_cores = os.sched_getaffinity(0)
    if cores:
        os.environ.update(omp_env(cores))
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import vllm.model_executor.model_loader  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.attention.backends.cpu_attn  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.executor.multiproc_executor  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401

    import llmesh.engine.worker  # noqa: F401

    compile_logprob_ranks()
    gc.collect()
    gc.freeze()  # vLLM's EngineCore collects every generation as it starts: 0.6-1.0 s unfrozen (measured)
    _prepared = True


def compile_logprob_ranks() -> bool:
    """vLLM counts each sampled token's rank (for logprobs) with a `torch.compile`d function, compiled on an
    engine's first request with logprobs (1.8-5 s on this machine, which the worker's warm-up pays). Compiled
    here instead, for any batch and vocabulary, the engine's forked processes inherit it. Only for a CPU
    engine whose kernels are single-threaded (one core), where the kernel compiled is the one the engine
    would compile: it runs once here, and an OpenMP team started in this process would not survive the fork."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or torch.get_num_threads() != 1:
        return False
    from torch._dynamo.decorators import mark_dynamic, mark_unbacked
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    logprobs, sampled = torch.zeros(2, 64), torch.zeros(2, 1)
    mark_unbacked(logprobs, 0)  # (as vLLM's sampler marks the batch: any size, 1 included)
    mark_unbacked(sampled, 0)
    mark_dynamic(logprobs, 1)  # any vocabulary
    with torch._inductor.config.patch(compile_threads=1):  # no compile workers in a process that forks
        batched_count_greater_than(logprobs, sampled)
    return True


def forks_its_engine(settings: WorkerSettings) -> bool:
    """Whether a worker started cold prepares as a standby does, so that its engine's processes are forked:
    where its engine has one rank on cores it was given. Several ranks need a core set each; cores that vLLM
    picks are not known before torch loads."""
    one_rank = settings.tensor_parallel_size == 1 == settings.pipeline_parallel_size
    return one_rank and bool(engine_cores(settings.cpu_cores)) and "|" not in settings.cpu_cores


def prepare_cold_start(settings: WorkerSettings) -> None:
    """A worker started as `python -m llmesh_prefill|llmesh_decode` prepares as a standby does where it may
    (`forks_its_engine`): its EngineCore and Worker are then forked from it instead of spawned as two more
    interpreters importing torch and vLLM again, about two thirds of a cold start (docs/activation-notes.md).
    Before torch loads, or the OpenMP runtime has read its settings: otherwise vLLM spawns them."""
    if _prepared or not forks_its_engine(settings):  # a standby that became this worker has prepared
        return
    if "torch" in sys.modules:
        log.warning("torch was loaded before the worker could set its engine's OpenMP threads: spawning the engine")
        return
    prepare(settings.cpu_cores)


@contextmanager
def forking_on(cores: str) -> Iterator[None]:
    """While vLLM forks a prepared worker's engine processes: every thread of this one on the engine's
    `cores`, which the EngineCore inherits (llmesh.engine.vllm_plugin keeps a spawned one there), then back
    on the cores it had before torch loaded, so that the service runs anywhere, as a spawning worker's does."""
    engine = engine_cores(cores)
    if engine:
        keep_on(engine)
    try:
        yield
    finally:
        if engine and _service_cores:
            keep_on(_service_cores)


def become(command: dict) -> None:
    """Run the command's worker module in this process, with its environment."""
    module, env = command["module"], command["env"]
    if not isinstance(module, str) or not module.startswith("llmesh_") or not isinstance(env, dict):
        raise ValueError(f"not a worker command: {command!r}")
    cores = os.environ.get("MESH_CPU_CORES", "")
    if env.get("MESH_CPU_CORES", cores) != cores:
        raise ValueError(f"this process was prepared for cores {cores!r}, not {env['MESH_CPU_CORES']!r}")
    os.environ.update({name: str(value) for name, value in env.items()})
    normal_priority()  # before any thread or process of the worker's
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    # run as `python -m`, this module is __main__: the worker's `import llmesh.engine.standby` must find it
    sys.modules.setdefault("llmesh.engine.standby", sys.modules[__name__])
    idle_priority()
    prepare(os.environ.get("MESH_CPU_CORES", ""))
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return
    become(json.loads(line))


if __name__ == "__main__":
    main()
