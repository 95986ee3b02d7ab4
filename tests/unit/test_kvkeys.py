"""KV identity: checkpoint digests and per-request chain seeds."""

from __future__ import annotations

import hashlib
import os

import pytest

from llmesh.wire import kvkeys
from llmesh.wire.kvkeys import block_hashes, chain_seed, checkpoint_identity, directory_digest

FP = "0" * 32


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def checkpoint(folder, weights: bytes, config: str = '{"hidden_size": 8}'):
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text(config)
    return folder


def test_new_weights_at_the_same_path_change_the_identity_even_with_size_and_mtime_kept(tmp_path):
    model = checkpoint(tmp_path / "m", b"a" * 4096)
    before = directory_digest(model)
    stat = (model / "model.safetensors").stat()
    with open(model / "model.safetensors", "r+b") as f:  # a fine-tune: same shapes, so same size
        f.write(b"b" * 4096)
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # `cp -p` keeps mtime
    assert directory_digest(model) != before


def test_config_and_tokenizer_files_are_part_of_the_identity(tmp_path):
    model = checkpoint(tmp_path / "m", b"w")
    first = checkpoint_identity(str(model), None)
    (model / "config.json").write_text('{"hidden_size": 8, "rope_theta": 1}')
    second = checkpoint_identity(str(model), None)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    third = checkpoint_identity(str(model), None, str(tokenizer))
    assert len({first, second, third}) == 3
    assert checkpoint_identity(str(model), None, str(model)) == second  # the model's own tokenizer


def test_identity_depends_on_content_not_on_where_the_checkpoint_lies(tmp_path):
    assert directory_digest(checkpoint(tmp_path / "a", b"w")) == directory_digest(checkpoint(tmp_path / "b", b"w"))


def test_unchanged_files_are_hashed_once(tmp_path, monkeypatch):
    model = checkpoint(tmp_path / "m", b"w" * 1000)
    directory_digest(model)
    calls = []
    real = hashlib.file_digest
    monkeypatch.setattr(kvkeys.hashlib, "file_digest", lambda f, algo: calls.append(f.name) or real(f, algo))
    directory_digest(model)
    assert calls == []
    (model / "config.json").write_text("{}")
    directory_digest(model)
    assert calls == [str(model / "config.json")]


def test_a_hub_cache_symlink_is_identified_by_its_blob_name(tmp_path, monkeypatch):
    blob = "ab" * 32
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / blob).write_bytes(b"weights")
    snapshot = tmp_path / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{blob}")
    monkeypatch.setattr(kvkeys.hashlib, "file_digest", lambda f, algo: pytest.fail("hashed a hub blob"))
    assert kvkeys.file_digest(snapshot / "model.safetensors") == f"blob:{blob}"


def test_a_checkpoint_that_cannot_be_found_locally_is_refused(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="cannot identify the checkpoint"):
        checkpoint_identity("no-such-org/no-such-model", None)


@pytest.mark.parametrize("salt, adapter", [(None, None), ("", None), (None, "")])
def test_no_salt_and_no_adapter_keep_the_fingerprint(salt, adapter):
    assert chain_seed(FP, salt, adapter) == FP


def test_salts_and_adapters_never_share_a_chunk():
    tokens = list(range(300))
    seeds = [
        chain_seed(FP),
        chain_seed(FP, "tenant-a"),
        chain_seed(FP, "tenant-b"),
        chain_seed(FP, None, "lora-1"),
        chain_seed(FP, "tenant-a", "lora-1"),
    ]
    chains = [block_hashes(seed, tokens, 128, partial=True) for seed in seeds]
    every_hash = [h for chain in chains for h in chain]
    assert len(set(every_hash)) == len(every_hash)
    assert block_hashes(chain_seed(FP, "tenant-a"), tokens, 128) == chains[1][:2]  # the same salt shares
