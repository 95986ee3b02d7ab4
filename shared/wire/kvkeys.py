"""KV identity: the layout fingerprint and chunk keys.

A chunk is one KV block of one layer's group of KV heads. Its key depends only on the
fingerprint, the chain of token-block hashes up to that block, the layer and the head group,
so equal prefixes give equal keys on every instance and KV from a different layout can never
be mistaken for ours. Head groups are what lets engines of different tensor-parallel sizes
share KV (BanaServe's attention-level granularity): a rank saves and loads only the groups of
the heads it holds, whatever the size of the engine that wrote them, so nothing is reshuffled.
The group size (`kv_heads_per_chunk`) is part of the fingerprint; the parallel sizes are not.

The fingerprint covers the checkpoint's content (weights, config, tokenizer), not only its
name and shapes: a new fine-tune at the same path never reads the old one's KV, even from a
store that outlived the restart. A request's chain is further seeded with its `cache_salt`
and LoRA adapter (`chain_seed`), so prefixes are shared only within a salt and an adapter.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from llmesh.wire.config import ConnectorConfig
from llmesh.wire.errors import KVFingerprintMismatch

log = logging.getLogger(__name__)

LAYOUT_VERSION = 3  # bump when the byte layout of a chunk or the key derivation changes
_BLOB_NAME = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")  # a hub cache blob is named by its content hash


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmesh" / "digests"


def file_digest(path: Path) -> str:
    """Content digest of one file. A hub cache's symlink names its blob's hash, which is used as
    is; other files are hashed once and remembered by (device, inode, size, mtime, ctime): any
    write changes ctime, which no user can set back."""
    if path.is_symlink():
        target = Path(os.readlink(path))
        if target.parent.name == "blobs" and _BLOB_NAME.match(target.name):
            return f"blob:{target.name}"
    st = path.stat()
    stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    entry = _cache_dir() / hashlib.blake2b(str(path.resolve()).encode(), digest_size=16).hexdigest()
    try:
        cached_stamp, cached = entry.read_text().split()
        if cached_stamp == stamp:
            return cached
    except (OSError, ValueError):
        pass
    with open(path, "rb") as f:
        digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}")
        tmp.write_text(f"{stamp} {digest}")
        tmp.replace(entry)
    except OSError as exc:  # a read-only home only costs hashing again next start
        log.debug("cannot cache the digest of %s: %s", path, exc)
    return digest


def directory_digest(path: str | Path) -> str:
    """Digest of every regular top-level file of a model or adapter folder (weights, config,
    tokenizer, ...), names included; hidden files and subfolders are not part of it."""
    folder = Path(path)
    digest = hashlib.blake2b(digest_size=16)
    for file in sorted(folder.iterdir()):
        if file.name.startswith(".") or not file.is_file():
            continue
        digest.update(f"{file.name}={file_digest(file)}\n".encode())
    return digest.hexdigest()


def local_folder(name: str, revision: str | None) -> Path:
    """The folder a model or tokenizer was loaded from: a path, or a hub name's local snapshot."""
    if os.path.isdir(name):
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception as exc:
        raise RuntimeError(
            f"cannot identify the checkpoint {name!r} (revision {revision}): it is neither a folder "
            f"nor in the local hub cache ({exc}); KV from unknown weights is never shared, so "
            "give the model as a local path"
        ) from None


def checkpoint_identity(
    model: str, revision: str | None, tokenizer: str | None = None, tokenizer_revision: str | None = None
) -> str:
    """Content identity of the weights, config and tokenizer an engine serves."""
    model_dir = local_folder(model, revision)
    parts = [directory_digest(model_dir)]
    if tokenizer and tokenizer != model:
        tokenizer_dir = local_folder(tokenizer, tokenizer_revision)
        if tokenizer_dir.resolve() != model_dir.resolve():
            parts.append(directory_digest(tokenizer_dir))
    return ":".join(parts)


def kv_bytes_per_token(layout: dict[str, Any], itemsize: int) -> int:
    """Bytes one token's K and V take over every layer and head (of `layout`, `kv_layout`'s)."""
    return 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_size"] * itemsize


def weights_bytes(model: str, revision: str | None = None) -> int:
    """Bytes of a checkpoint's weight files (safetensors, else .bin): what an engine holds for its weights."""
    folder = local_folder(model, revision)
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def rank_heads(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one tensor-parallel rank holds (vLLM gives each rank a copy of one when there are
    fewer heads than ranks)."""
    return max(num_kv_heads // tensor_parallel_size, 1)


def rank_first_head(num_kv_heads: int, tensor_parallel_size: int, rank: int) -> int:
    return rank * num_kv_heads // tensor_parallel_size


def heads_per_chunk(num_kv_heads: int, tensor_parallel_size: int, configured: int = 0) -> int:
    """The KV heads of one chunk: `configured`, which must divide a rank's share, or 0 for that share."""
    share = rank_heads(num_kv_heads, tensor_parallel_size)
    if configured and share % configured:
        raise ValueError(
            f"kv_heads_per_chunk={configured} does not divide the {share} KV heads each of the "
            f"{tensor_parallel_size} tensor-parallel ranks holds ({num_kv_heads} in all)"
        )
    return configured or share


def check_sizes_can_share(tensor_parallel_sizes: Iterable[int], configured: int | None) -> None:
    """Raise ValueError when engines of different tensor-parallel sizes would run without a common
    head-group size: by default each chunk holds one rank's share, which differs between them."""
    if len(set(tensor_parallel_sizes)) > 1 and not configured:
        raise ValueError(
            "engines of different tensor-parallel sizes exchange KV only in head groups that divide "
            "every rank's share: set MESH_KV_HEADS_PER_CHUNK (--kv-heads-per-chunk) on all of them, "
            "e.g. the KV heads of one rank of the largest (2 for the embedded tiny model's 4 at 2 ranks)"
        )


def kv_layout(vllm_config: Any) -> dict[str, Any]:
    """Everything that must agree for a KV block computed here to be valid elsewhere: not the
    parallel sizes, since chunks hold whole head groups of one layer (global layer numbers)."""
    from vllm.platforms import current_platform

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    hf = model.hf_text_config
    transfer = vllm_config.kv_transfer_config
    configured = (
        ConnectorConfig.from_extra(transfer.kv_connector_extra_config).kv_heads_per_chunk
        if transfer is not None and transfer.kv_connector_extra_config
        else 0
    )
    num_kv_heads = model.get_total_num_kv_heads()
    return {
        "layout_version": LAYOUT_VERSION,
        "model": model.served_model_name or model.model,
        "checkpoint": checkpoint_identity(model.model, model.revision, model.tokenizer, model.tokenizer_revision),
        "architecture": (model.architectures or ["?"])[0],
        "hidden_size": hf.hidden_size,
        "vocab_size": hf.vocab_size,
        "num_layers": model.get_total_num_hidden_layers(),
        "num_kv_heads": num_kv_heads,
        "kv_heads_per_chunk": heads_per_chunk(num_kv_heads, parallel.tensor_parallel_size, configured),
        "head_size": model.get_head_size(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "device": current_platform.device_type,
    }


def fingerprint(layout: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16).hexdigest()


def check_same_layout(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Raise a KVFingerprintMismatch naming every field that differs."""
    if fingerprint(ours) == fingerprint(theirs):
        return
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    diffs = [f"{k}: {theirs.get(k)!r} there vs {ours.get(k)!r} here" for k in differ]
    hint = (
        "; workers of different tensor-parallel sizes need the same MESH_KV_HEADS_PER_CHUNK"
        if "kv_heads_per_chunk" in differ
        else ""
    )
    raise KVFingerprintMismatch("KV layouts differ between prefill and decode (" + "; ".join(diffs) + ")" + hint)


@functools.cache
def adapter_digest(path: str) -> str:
    """A LoRA adapter folder's content identity (`directory_digest`), read once a process: an adapter's files
    do not change under a name (vLLM refuses to load one again under it)."""
    return directory_digest(path)


def chain_seed(fp: str, cache_salt: str | None = None, adapter: str | None = None) -> str:
    """What a request's block-hash chain starts from: the fingerprint, plus its cache salt and
    the identity of its LoRA adapter when it has them (tenants and adapters never share KV)."""
    if not cache_salt and not adapter:
        return fp
    return hashlib.blake2b(json.dumps([fp, cache_salt or "", adapter or ""]).encode(), digest_size=16).hexdigest()


def block_hashes(fp: str, token_ids: Sequence[int], block_size: int, *, partial: bool = False) -> list[str]:
    """Hash chain over the blocks of `token_ids`, seeded with `fp` (the fingerprint or a `chain_seed`).

    Full blocks only, unless `partial`: then a trailing partial block gets a hash too (its
    token count is part of what is hashed, so it never equals a longer block's).
    """
    h = bytes.fromhex(fp)
    out = []
    end = len(token_ids) if partial else len(token_ids) - len(token_ids) % block_size
    for start in range(0, end, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        out.append(h.hex())
    return out


def tail_hash(tail_id: str, block_index: int) -> str:
    """The key of a block a decode worker exported when it stopped a request (a migration's source):
    named by the request's engine admission (`tail_id`, unique to it) and the block's index, since the
    engine may have computed a few more tokens into it than the caller has seen."""
    return hashlib.blake2b(f"tail:{tail_id}:{block_index}".encode(), digest_size=16).hexdigest()


def chunk_key(block_hash: str, layer: int, head_group: int) -> str:
    return f"{block_hash}:{layer}:{head_group}"


def head_groups(layout: dict[str, Any]) -> int:
    return layout["num_kv_heads"] // layout["kv_heads_per_chunk"]


def block_chunk_keys(block_hash: str, layout: dict[str, Any]) -> list[str]:
    """Every chunk of one block: all layers, all head groups."""
    return [
        chunk_key(block_hash, layer, group)
        for layer in range(layout["num_layers"])
        for group in range(head_groups(layout))
    ]


# ---- the shared chunk index in Redis (written by kv-store shards, read by clients) ----------------

INDEX_KEY = "llmesh:kv:chunks"  # hash: chunk key -> "shard size last_access"


def encode_entry(shard: str, size: int, last_access: float) -> str:
    return f"{shard} {size} {last_access:.3f}"


def decode_entry(value: bytes | str) -> tuple[str, int, float]:
    shard, size, last = (value.decode() if isinstance(value, bytes) else value).rsplit(" ", 2)
    return shard, int(size), float(last)
