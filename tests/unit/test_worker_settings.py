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


def test_kv_blocks_and_the_engines_spin_must_be_positive(monkeypatch):
    monkeypatch.setenv("MESH_KV_BLOCKS", "0")
    with pytest.raises(pydantic.ValidationError, match="kv_blocks"):
        WorkerSettings()
    monkeypatch.delenv("MESH_KV_BLOCKS")
    monkeypatch.setenv("MESH_ENGINE_SPIN_S", "0")  # vLLM's wake-ups get lost without any spin
    with pytest.raises(pydantic.ValidationError, match="engine_spin_s"):
        WorkerSettings()


def test_an_empty_variable_unsets_an_optional_setting_and_only_that(monkeypatch):
    from llmesh_router.settings import RouterSettings

    for name in ("MESH_LOCAL_PREFILL_MARGIN_S", "MESH_ENGINE_SPIN_S", "MESH_TRACE_DIR", "MESH_CPU_CORES"):
        monkeypatch.setenv(name, "")
    assert RouterSettings().local_prefill_margin_s is None  # documented: empty means always disaggregate
    worker = WorkerSettings()
    assert worker.engine_spin_s is None and worker.trace_dir is None
    assert worker.cpu_cores == ""  # a plain string stays empty


CATALOGUE = (
    '[{"name": "chat", "model": "llmesh/tiny-llama", "ttft_slo_ms": 500},'
    ' {"name": "code", "model": "llmesh/tiny-llama-b", "tensor_parallel_size": 2}]'
)


def test_a_worker_serves_the_catalogue_entry_it_names_with_its_weights_and_parallel_size(monkeypatch):
    from llmesh_router.settings import RouterSettings

    for name in ("MESH_MODEL", "MESH_SERVED_MODEL_NAME", "MESH_TENSOR_PARALLEL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MESH_MODELS", CATALOGUE)
    first = WorkerSettings()
    assert (first.model_name, first.model, first.tensor_parallel_size) == ("chat", "llmesh/tiny-llama", 1)
    monkeypatch.setenv("MESH_SERVED_MODEL_NAME", "code")
    code = WorkerSettings()
    assert (code.model_name, code.model, code.tensor_parallel_size) == ("code", "llmesh/tiny-llama-b", 2)
    assert [m.name for m in RouterSettings().catalogue()] == ["chat", "code"]
    assert RouterSettings().catalogue()[0].ttft_slo_ms == 500
    monkeypatch.setenv("MESH_TENSOR_PARALLEL_SIZE", "1")  # set explicitly: kept
    assert WorkerSettings().tensor_parallel_size == 1


@pytest.mark.parametrize(
    "env, error",
    [
        ({"MESH_SERVED_MODEL_NAME": "nope"}, "'nope' is not in MESH_MODELS"),
        ({"MESH_MODEL": "llmesh/small-llama"}, "differs from MESH_MODELS' 'chat'"),
        ({"MESH_MODELS": '[{"name": "a"}, {"name": "a"}]'}, "model and adapter names must be unique"),
        ({"MESH_MODELS": '[{"name": "a", "weights": "x"}]'}, "Extra inputs are not permitted"),
        ({"MESH_MODELS": '[{"name": ""}]'}, "at least 1 character"),
    ],
)
def test_a_catalogue_that_does_not_add_up_is_refused_by_name(monkeypatch, env, error):
    monkeypatch.setenv("MESH_MODELS", CATALOGUE)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(pydantic.ValidationError, match=error):
        WorkerSettings()


def test_without_a_catalogue_the_mesh_has_the_one_model_mesh_model_names(monkeypatch):
    monkeypatch.delenv("MESH_MODELS", raising=False)
    monkeypatch.setenv("MESH_MODEL", "llmesh/small-llama")
    monkeypatch.setenv("MESH_SERVED_MODEL_NAME", "small")
    [only] = WorkerSettings().catalogue()
    assert (only.name, only.model) == ("small", "llmesh/small-llama")
