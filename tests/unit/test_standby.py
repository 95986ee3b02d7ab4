"""The pre-started worker process's command (llmesh.engine.standby); its activation on real engines is
tests/e2e/test_models.py."""

import os

import pytest

from llmesh.engine import standby


@pytest.mark.parametrize(
    "command, error",
    [
        ({"module": "os", "env": {}}, "not a worker command"),
        ({"module": "llmesh_decode", "env": []}, "not a worker command"),
        ({"module": "llmesh_decode", "env": {"MESH_CPU_CORES": "5"}}, "prepared for cores '1', not '5'"),
    ],
)
def test_a_command_it_cannot_carry_out_is_refused_before_it_runs_anything(monkeypatch, command, error):
    monkeypatch.setenv("MESH_CPU_CORES", "1")
    with pytest.raises(ValueError, match=error):
        standby.become(command)


def test_the_openmp_settings_are_those_vllm_gives_a_worker_of_the_cores():
    assert standby.omp_env("0-1") == {"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
    assert not standby.prepared()  # nothing here was pre-started: engines are spawned as vLLM chooses


def test_a_standby_prepares_at_idle_priority_only_where_it_may_take_the_normal_policy_back():
    import resource
    import threading

    from llmesh.engine.standby import idle_priority, normal_priority

    allowed = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
    seen = []

    def in_a_thread():  # the policy is a thread's: this one's, not the test process's
        seen.append((idle_priority(), os.sched_getscheduler(0) == os.SCHED_IDLE))
        seen.append((normal_priority(), os.sched_getscheduler(0) == os.SCHED_OTHER))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [(allowed, allowed), (True, True)]


@pytest.mark.parametrize(
    "env, forks",
    [
        ({"MESH_CPU_CORES": "1"}, True),
        ({"MESH_CPU_CORES": "0-3"}, True),
        ({"MESH_CPU_CORES": ""}, False),  # vLLM picks the cores, after torch has loaded
        ({"MESH_CPU_CORES": "auto"}, False),
        ({"MESH_CPU_CORES": "0-1", "MESH_TENSOR_PARALLEL_SIZE": "2"}, False),  # it needs a core set a rank
        ({"MESH_CPU_CORES": "0-1", "MESH_PIPELINE_PARALLEL_SIZE": "2"}, False),
    ],
)
def test_a_cold_worker_forks_its_engine_only_where_it_has_one_rank_on_cores_it_was_given(monkeypatch, env, forks):
    from llmesh.wire.config import WorkerSettings

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert standby.forks_its_engine(WorkerSettings()) is forks


def test_a_worker_module_loads_no_torch_before_it_can_set_its_engines_openmp_threads():
    """torch reads the OpenMP settings once, as it loads: a worker's `__main__` must not load it before
    `run_worker` prepares (a worker that finds it loaded spawns its engine, as vLLM ships)."""
    import subprocess
    import sys

    probe = "import sys, llmesh_prefill.__main__, llmesh_decode.__main__; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_worker_that_finds_torch_loaded_does_not_prepare(monkeypatch, caplog):
    import torch  # noqa: F401  (loaded in this test process by other tests anyway)

    from llmesh.wire.config import WorkerSettings

    monkeypatch.setenv("MESH_CPU_CORES", "0")
    standby.prepare_cold_start(WorkerSettings())
    assert not standby.prepared() and "spawning the engine" in caplog.text


def test_vllms_logprob_rank_count_compiled_before_the_fork_serves_the_engines_any_batch_and_vocabulary():
    """What a one-core engine's forked processes inherit: nothing compiled on their requests with logprobs,
    whatever the batch and vocabulary, counts equal to the eager ones, and no thread or process left in the
    one that forks. With more threads (an OpenMP team would not survive the fork) nothing is compiled."""
    import subprocess
    import sys

    probe = """
import os, sys, torch
from llmesh.engine import standby
threads = len(os.listdir("/proc/self/task"))
print(standby.compile_logprob_ranks())
if torch.get_num_threads() == 1:
    import psutil
    assert len(os.listdir("/proc/self/task")) == threads and not psutil.Process().children()
    pid = os.fork()
    if pid == 0:
        from torch._dynamo.decorators import mark_unbacked
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than
        from torch._dynamo.utils import counters
        frames = counters["frames"]["total"]
        for batch, vocab in ((1, 2000), (3, 2000), (5, 128256)):
            logprobs = torch.randn(batch, vocab).log_softmax(-1)
            sampled = logprobs.gather(-1, torch.randint(vocab, (batch, 1)))
            mark_unbacked(logprobs, 0), mark_unbacked(sampled, 0)  # (as vLLM's sampler calls it)
            assert torch.equal(batched_count_greater_than(logprobs, sampled), (logprobs >= sampled).sum(-1))
        os._exit(0 if counters["frames"]["total"] == frames else 3)  # (a frame compiled: not inherited)
    assert os.waitpid(pid, 0)[1] == 0
"""
    for threads, compiled in (("1", "True"), ("2", "False")):
        env = os.environ | {"OMP_NUM_THREADS": threads}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.split()[-1] == compiled, done.stderr[-3000:]
