"""bench/activation.py's bookkeeping, without starting an engine: vLLM's log lines become phases in
order, the summary compares every mode with the cold start and checks exactness."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_activation", ROOT / "bench" / "activation.py")
assert spec and spec.loader
activation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(activation)

LOG = """\
@99.000 MainProcess vllm.renderers.registry Loading HfRenderer for renderer_mode='hf'
@100.100 MainProcess vllm.renderers.registry Loading HfRenderer for renderer_mode='hf'
not a log line
@101.000 EngineCore vllm.v1.engine.core Waiting for init message from front-end.
@102.000 VllmWorker-0 vllm.plugins Available plugins for group vllm.general_plugins:
@102.500 VllmWorker-0 vllm.v1.worker.cpu_model_runner Starting to load model /m...
@102.600 VllmWorker-0 vllm.model_executor.model_loader.default_loader Loading weights took 0.02 seconds
@103.000 VllmWorker-0 vllm.v1.worker.cpu_worker Explicitly set (1.0/23.59) GiB for KV cache on node 0.
@103.500 EngineCore vllm.v1.engine.core init engine (profile, create kv cache, warmup model) took 0.54 s
@104.000 MainProcess vllm.v1.engine.utils READY from local core engine process 0.
"""


def test_log_lines_after_the_command_end_the_phases_in_order():
    marks = activation._log_marks(LOG, after=100.0)
    assert marks == {
        "api_configured": 100.1,
        "core_up": 101.0,
        "worker_up": 102.0,
        "load_start": 102.5,
        "weights_read": 102.6,
        "kv_start": 103.0,
        "kv_done": 103.5,
        "ready": 104.0,
    }
    marks |= {"build": 100.05, "built": 104.1, "first": 104.3}
    phases = activation._phases(marks, start=100.0)
    assert list(phases) == [name for name, mark in activation.PHASES if mark in marks]  # in the order of PHASES
    assert abs(sum(phases.values()) - 4.3) < 1e-9
    assert abs(phases["Worker process start + its imports"] - 1.0) < 1e-9


def test_the_summary_gives_ratios_to_the_cold_median_and_checks_every_output():
    def run(mode, seconds, tokens=(5, 6)):
        return {"mode": mode, "model": "m", "seconds": seconds, "phases": {"p": seconds}, "tokens": list(tokens)}

    runs = [run("cold", 30), run("pool-fork", 3), run("cold", 34), run("pool-fork", 5), run("cold", 32)]
    summary = activation.summarize(runs + [run("reload", 0.1, tokens=(5, 7))])["m"]
    assert summary["cold"]["seconds"] == {"median": 32, "min": 30, "max": 34}
    assert summary["pool-fork"]["ratio_to_cold"] == 4 / 32
    assert summary["pool-fork"]["exact"] is True
    assert summary["reload"]["exact"] is False  # another output than the cold engine's
    assert "NO" in activation.table({"m": summary})
    assert activation.summarize([run("reload", 0.1)])["m"]["reload"]["exact"] is None  # nothing to compare with
