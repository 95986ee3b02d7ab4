"""KV identity: the layout fingerprint and chunk keys.

A chunk is one KV block of one layer. Its key depends only on the fingerprint, the chain
of token-block hashes up to that block, and the layer, so equal prefixes give equal keys
on every instance and KV from a different layout can never be mistaken for ours.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from typing import Any

from llmesh.errors import KVFingerprintMismatch

LAYOUT_VERSION = 1  # bump when the byte layout of a chunk changes


def kv_layout(vllm_config: Any) -> dict[str, Any]:
    """Everything that must agree for a KV block computed here to be valid elsewhere."""
    from vllm.platforms import current_platform

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    hf = model.hf_text_config
    return {
        "layout_version": LAYOUT_VERSION,
        "model": model.served_model_name or model.model,
        "architecture": (model.architectures or ["?"])[0],
        "hidden_size": hf.hidden_size,
        "vocab_size": hf.vocab_size,
        "num_layers": model.get_num_layers(parallel),
        "num_kv_heads": model.get_num_kv_heads(parallel),
        "head_size": model.get_head_size(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "device": current_platform.device_type,
    }


def fingerprint(layout: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16).hexdigest()


def check_same_layout(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Raise a KVFingerprintMismatch naming every field that differs."""
    if fingerprint(ours) == fingerprint(theirs):
        return
    diffs = [f"{k}: {theirs.get(k)!r} there vs {ours.get(k)!r} here" for k in sorted(ours.keys() | theirs.keys())
             if ours.get(k) != theirs.get(k)]
    raise KVFingerprintMismatch("KV layouts differ between prefill and decode (" + "; ".join(diffs) + ")")


def block_hashes(fp: str, token_ids: Sequence[int], block_size: int, *, partial: bool = False) -> list[str]:
    """Hash chain over the blocks of `token_ids`, seeded with the fingerprint.

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


def chunk_key(block_hash: str, layer: int) -> str:
    return f"{block_hash}:{layer}"


# ---- the shared chunk index in Redis (written by kv-store shards, read by clients) ----------------

INDEX_KEY = "llmesh:kv:chunks"  # hash: chunk key -> "shard size last_access"


def encode_entry(shard: str, size: int, last_access: float) -> str:
    return f"{shard} {size} {last_access:.3f}"


def decode_entry(value: bytes | str) -> tuple[str, int, float]:
    shard, size, last = (value.decode() if isinstance(value, bytes) else value).rsplit(" ", 2)
    return shard, int(size), float(last)
