"""The launcher's supervision, on real child processes (no mesh)."""

import os
import sys
import time

import pytest

from llmesh.deploy.launcher import Child, Supervised, stop_all


def test_a_failed_child_restarts_at_once_then_with_growing_delays_and_one_done_stays_down(tmp_path):
    now = [0.0]
    runs = tmp_path / "runs"
    exit_codes = iter([3, 3, 3, 0])

    def start() -> Child:
        with runs.open("a") as f:
            f.write("run\n")
        return Child("flaky", [sys.executable, "-c", f"raise SystemExit({next(exit_codes)})"])

    service = Supervised("flaky", start, clock=lambda: now[0])

    def starts_after(wait_s: float) -> None:
        service.child.proc.wait(10)
        before = runs.read_text().count("run")
        service.check()  # notices the exit
        if wait_s:
            assert service.child is None
            now[0] += wait_s - 0.01
            service.check()
            assert service.child is None, "started again before its delay"
            now[0] += 0.01
            service.check()
        assert runs.read_text().count("run") == before + 1

    starts_after(0.0)  # the first failure: at once
    starts_after(1.0)  # then 1 s, 2 s, ...
    starts_after(2.0)
    service.child.proc.wait(10)
    service.check()  # status 0: done on purpose
    now[0] += 100
    service.check()
    assert service.done and service.child is None and runs.read_text().count("run") == 4


def test_aggregated_engines_count_each_models_replicas_up_to_autoscalings_maximum():
    from llmesh.deploy.launcher import aggregated_engines
    from llmesh.wire.config import ScalingSettings

    fixed = ScalingSettings(_env_file=None, placement_autoscale=False, placement_max_decode_workers=4)
    assert aggregated_engines(3, 1, fixed) == 3
    assert aggregated_engines(1, 2, fixed) == 2  # two replicas of one model: a core each on two cores
    scaling = ScalingSettings(_env_file=None, placement_autoscale=True, placement_max_decode_workers=2)
    assert aggregated_engines(1, 1, scaling) == 2  # the replica autoscaling may add counts from the start
    assert aggregated_engines(2, 3, scaling) == 6


def test_engines_get_their_half_of_the_cores_and_a_group_a_tensor_parallel_rank(monkeypatch):
    from llmesh.deploy.launcher import engine_cores

    monkeypatch.delenv("MESH_CPU_CORES", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert engine_cores() == {"prefill-worker": {"MESH_CPU_CORES": "0-3"}, "decode-worker": {"MESH_CPU_CORES": "4-7"}}
    assert engine_cores({"prefill-worker": 2})["prefill-worker"] == {"MESH_CPU_CORES": "0-1|2-3"}
    # aggregated models only: their engines share the cores, unbound, the cores over the engines a thread each
    assert engine_cores(roles={"decode"}, engines=3) == {
        "decode-worker": {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    }
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert engine_cores({"prefill-worker": 2, "decode-worker": 1}) == {
        "prefill-worker": {"MESH_CPU_CORES": "0|1"},
        "decode-worker": {"MESH_CPU_CORES": "1"},
    }
    monkeypatch.setenv("MESH_CPU_CORES", "0")
    assert engine_cores({"prefill-worker": 2}) == {}


def test_a_restarted_child_runs_the_same_command_again_into_the_same_log(tmp_path):
    log = tmp_path / "child.log"
    child = Child(
        "once", [sys.executable, "-c", "import os; print('run', os.getpid()); raise SystemExit(3)"], log_path=log
    )
    first = child.pid
    assert child.proc.wait(10) == 3
    child.restart()
    assert child.proc.wait(10) == 3 and child.pid != first
    assert child.log_tail().splitlines() == [f"run {first}", f"run {child.pid}"]
    assert child.log_tail(lines=1) == f"run {child.pid}"
    child.stop()


def test_a_child_has_its_own_process_group_in_the_launchers_session(tmp_path):
    """killpg stops a service with its engine processes; a session of its own would also give it an
    autogroup of its own, and the kernel let one busy engine's group starve another's on a shared core
    for seconds (a migration's prefetch on the starved one waited out its limit)."""
    log = tmp_path / "child.log"
    child = Child(
        "ids", [sys.executable, "-c", "import os; print(os.getpid(), os.getpgid(0), os.getsid(0))"], log_path=log
    )
    assert child.proc.wait(10) == 0
    pid, pgid, sid = map(int, child.log_tail().split())
    assert pid == pgid == child.pid, "its own process group (the launcher kills it with killpg)"
    assert sid == os.getsid(0), "the launcher's session: no autogroup of its own"
    child.stop()


def test_stopping_children_signals_each_once_so_its_shutdown_runs_to_the_end(tmp_path):
    """A service takes a second SIGTERM as "stop now": stop_all (SIGTERM to all, then each child's
    stop) must not send it twice (the kv-store's shutdown was cut short closing its Redis index)."""
    log = tmp_path / "child.log"
    script = (
        "import signal, sys, time\n"
        "def on_term(*_):\n"
        "    print('term', flush=True)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "print('up', flush=True)\n"
        "time.sleep(1.5)\n"
    )
    child = Child("graceful", [sys.executable, "-c", script], log_path=log)
    while "up" not in child.log_tail():
        time.sleep(0.05)
    stop_all([child], timeout=10)
    assert child.log_tail().splitlines() == ["up", "term"]


def test_each_started_model_gets_its_workers_named_after_it_and_an_unknown_one_is_refused():
    from llmesh.deploy.launcher import started_models, worker_envs
    from llmesh.wire.config import ServedModel

    assert worker_envs("prefill-worker", 1) == [("prefill-worker", {})]
    assert worker_envs("decode-worker", 2, "llmesh/tiny-llama") == [
        ("decode-worker-llmesh-tiny-llama-0", {"MESH_WORKER_ID": "decode-llmesh-tiny-llama-0"} | SERVED),
        ("decode-worker-llmesh-tiny-llama-1", {"MESH_WORKER_ID": "decode-llmesh-tiny-llama-1"} | SERVED),
    ]
    catalogue = [ServedModel(name="a"), ServedModel(name="b"), ServedModel(name="c")]
    assert [m.name for m in started_models(catalogue, None)] == ["a", "b", "c"]
    assert [m.name for m in started_models(catalogue, ["c", "a"])] == ["a", "c"]
    with pytest.raises(ValueError, match="not in the catalogue.*: x"):
        started_models(catalogue, ["a", "x"])


SERVED = {"MESH_SERVED_MODEL_NAME": "llmesh/tiny-llama"}


def test_a_child_with_its_input_kept_open_reads_what_is_sent_later(tmp_path):
    log = tmp_path / "echo.log"
    child = Child(
        "echo", [sys.executable, "-c", "import sys; print('got', sys.stdin.read())"], log_path=log, keep_stdin=True
    )
    time.sleep(0.2)
    assert child.alive()  # waiting for its input
    child.send("hello\n")
    child.proc.wait(10)
    child.stop()
    assert log.read_text().strip() == "got hello"
