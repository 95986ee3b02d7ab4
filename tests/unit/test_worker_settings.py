"""Settings read from the environment. (That the engine gets them is checked on real
engines: tests/e2e/test_dispatch_policy.py reads a capped worker's KV blocks from its heartbeat.)"""

import pydantic
import pytest

from llmesh.wire.config import WorkerSettings


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("24", 24)])
def test_kv_blocks_caps_the_engine_only_when_set(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("MESH_KV_BLOCKS", raising=False)
    else:
        monkeypatch.setenv("MESH_KV_BLOCKS", value)
    assert WorkerSettings().kv_blocks == expected


def test_kv_blocks_must_be_positive(monkeypatch):
    monkeypatch.setenv("MESH_KV_BLOCKS", "0")
    with pytest.raises(pydantic.ValidationError, match="kv_blocks"):
        WorkerSettings()


def test_an_empty_variable_unsets_an_optional_setting_and_only_that(monkeypatch):
    from llmesh_router.settings import RouterSettings

    for name in ("MESH_LOCAL_PREFILL_MARGIN_S", "MESH_ENGINE_SPIN_S", "MESH_TRACE_DIR", "MESH_CPU_CORES"):
        monkeypatch.setenv(name, "")
    assert RouterSettings().local_prefill_margin_s is None  # documented: empty means always disaggregate
    worker = WorkerSettings()
    assert worker.engine_spin_s is None and worker.trace_dir is None
    assert worker.cpu_cores == ""  # a plain string stays empty
