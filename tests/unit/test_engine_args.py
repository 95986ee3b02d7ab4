"""A catalogue model's vLLM engine arguments: read by vLLM's own parser (names and values), refused where the
mesh sets them itself, over the workers' engine settings, and checked by `make run` before any engine starts."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from llmesh.wire.config import MESH_ENGINE_ARGS, ServedModel, WorkerSettings
from llmesh.wire.engine_args import check, vllm_values


def model(**engine_args: object) -> ServedModel:
    return ServedModel(name="m", engine_args=engine_args)


def test_values_come_back_in_vllms_own_types_whichever_spelling_names_them():
    given = {
        "max-num-batched-tokens": "8k",  # (vLLM's human-readable sizes)
        "--max-num-seqs": 4,
        "trust_remote_code": True,
        "enforce_eager": False,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        "cudagraph_capture_sizes": [1, 2, 4],
        "limit_mm_per_prompt": {"image": 2},
        "kv_cache_dtype": "fp8",
        "revision": "main",
        "max_lora_rank": 16,
        "enable_chunked_prefill": False,
        "seed": None,  # vLLM's default
    }
    as_named = {key.lstrip("-").replace("-", "_"): value for key, value in given.items() if value is not None}
    assert vllm_values(ServedModel(name="m", engine_args=given)) == as_named | {"max_num_batched_tokens": 8000}


@pytest.mark.parametrize(
    "args, message",
    [
        ({"max_num_batch_tokens": 8}, "not an engine argument of vLLM (did you mean max_num_batched_tokens"),
        ({"kv_cache_dtype": "fp9"}, "'kv_cache_dtype': argument --kv-cache-dtype: invalid choice: 'fp9'"),
        ({"max_num_seqs": "many"}, "'max_num_seqs': argument --max-num-seqs: invalid int value: 'many'"),
        ({"max_lora_rank": 7}, "invalid choice: 7"),
        ({"enforce_eager": "yes"}, "'enforce_eager': enforce_eager is a switch: true or false"),
        ({"speculative_config": "{not json"}, "'speculative_config'"),
    ],
)
def test_an_unknown_name_or_a_bad_value_is_an_error_naming_the_model_and_the_argument(args, message):
    with pytest.raises(ValueError, match="^model 'm': engine_args ") as refused:
        check([ServedModel(name="ok"), model(**args)])
    assert message in str(refused.value)


@pytest.mark.parametrize("name", sorted(MESH_ENGINE_ARGS))
def test_what_the_mesh_sets_itself_is_refused_with_what_to_set_instead(name):
    with pytest.raises(ValidationError, match=f"the mesh sets '{name}' itself; set "):
        model(**{name.replace("_", "-"): 1})


def test_an_argument_given_twice_is_refused():
    with pytest.raises(ValidationError, match="sets 'max_num_seqs' twice"):
        model(max_num_seqs=3, **{"max-num-seqs": 4})


def worker_settings(monkeypatch, entry: dict, **env: str) -> WorkerSettings:
    for key in ("MESH_MODEL", "MESH_CAPACITY", "MESH_SERVED_MODEL_NAME", "MESH_DTYPE", "MESH_MAX_MODEL_LEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MESH_MODELS", json.dumps([{"name": "m"} | entry]))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return WorkerSettings(_env_file=None)


def test_a_models_max_num_seqs_is_its_workers_capacity(monkeypatch):
    assert worker_settings(monkeypatch, {"engine_args": {"max_num_seqs": 5}}).capacity == 5
    assert worker_settings(monkeypatch, {"engine_args": {"max_num_seqs": 5}}, MESH_CAPACITY="5").capacity == 5
    with pytest.raises(ValidationError, match="MESH_CAPACITY=7 differs from 'm''s max_num_seqs 5"):
        worker_settings(monkeypatch, {"engine_args": {"max_num_seqs": 5}}, MESH_CAPACITY="7")


def test_the_engine_gets_the_models_arguments_over_the_workers_settings_and_the_meshs_own(monkeypatch, tmp_path):
    from llmesh.engine.worker import engine_args

    settings = worker_settings(
        monkeypatch,
        {"engine_args": {"max_num_batched_tokens": 64, "dtype": "float32", "max_model_len": 512}},
        MESH_MAX_MODEL_LEN="1024",
        MESH_BLOCK_SIZE="64",
        MESH_MODEL_DIR=str(tmp_path),
    )
    (tmp_path / "weights").mkdir()  # a folder of MESH_MODEL_DIR, named in the catalogue
    monkeypatch.setenv("MESH_MODELS", json.dumps([{"name": "m", "model": "weights"} | {"engine_args": {"seed": 3}}]))
    args = engine_args(settings, "decode")
    assert (args.max_num_batched_tokens, args.dtype, args.max_model_len) == (64, "float32", 512)
    assert (args.block_size, args.max_num_seqs, args.served_model_name) == (64, 256, "m")
    assert args.kv_transfer_config.kv_connector == "MeshKVConnector"
    folder = engine_args(WorkerSettings(_env_file=None), "decode")
    assert (folder.model, folder.seed, folder.dtype) == (str(tmp_path / "weights"), 3, "auto")


@pytest.mark.parametrize(
    "env, refused",
    [
        ({"MESH_GPU_MEMORY_UTILIZATION": "7"}, "gpu_memory_utilization"),
        ({"MESH_BLOCK_SIZE": "-3"}, "block_size"),
        ({"MESH_MAX_MODEL_LEN": "0"}, "max_model_len"),
        ({"MESH_HEARTBEAT_S": "0"}, "heartbeat_s"),
    ],
)
def test_numeric_settings_that_cannot_be_right_are_refused(monkeypatch, env, refused):
    with pytest.raises(ValidationError, match=refused):
        worker_settings(monkeypatch, {}, **env)


def test_a_token_is_never_shown_only_where_it_comes_from(monkeypatch, tmp_path):
    settings = worker_settings(monkeypatch, {}, HF_TOKEN="hf_secret")
    assert settings.hf_token_source() == "HF_TOKEN" and "hf_secret" not in repr(settings)
    monkeypatch.delenv("HF_TOKEN")
    settings = worker_settings(monkeypatch, {}, HF_TOKEN_PATH=str(tmp_path / "token"))
    assert settings.hf_token_source() == f"the file {tmp_path / 'token'} (missing: none)"


def test_make_run_refuses_bad_engine_arguments_before_it_starts_anything(monkeypatch, capsys):
    from llmesh.deploy.launcher import main

    monkeypatch.setenv("MESH_MODELS", json.dumps([{"name": "m", "engine_args": {"max_num_seqs": "x"}}]))
    with pytest.raises(SystemExit):
        main([])
    assert "model 'm': engine_args 'max_num_seqs'" in capsys.readouterr().err
