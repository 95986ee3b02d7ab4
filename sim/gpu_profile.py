"""Fit the simulator's engine model to published H100 measurements of Llama-2-7B (Microsoft Vidur).

    .venv/bin/python -m llmesh_sim.gpu_profile --vidur PATH [--out sim/profiles/h100-llama2-7b.json]

PATH is a checkout of github.com/microsoft/vidur, or a folder holding the model's `mlp.csv` (and
`attention.csv`). Vidur profiled each operation of a Llama-2-7B layer on one H100
(TP 1, bf16) and predicts a batch's time as the number of layers times the sum of its operations'
GPU times. This does the same for representative batches: a lone prompt of n tokens (one prefill
step, as vLLM runs it with chunked prefill up to `max_num_batched_tokens`) and B requests decoding
at a context of c tokens; then fits `EngineProfile`'s step time by least squares on relative error,
prints each batch beside the fit and writes the profile.

The per-token operations (norms, QKV/O projections, rotary, MLP, residual adds) come from Vidur's
`mlp.csv`. Attention comes from Vidur's `attention.csv` when it is there; where it is not (the
public snapshot this profile was made from lists the H100 file but lacks its contents), from
published figures: FlashAttention-3's causal forward throughput on an H100 SXM5 (head dim 128),
and decode attention as the KV cache read at the H100's HBM bandwidth with the efficiency and fixed
time that Vidur's own decode-attention measurements (A100) show. The LM head (Vidur leaves it out)
is scaled from the measured MLP up-projection, a GEMM of the same depth. CPU time per step
(scheduling, input preparation) is not modelled, as in Vidur's default.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

from .calibrate import Point, fitted_profile, write_profile
from .engine import attention_pairs

# Llama-2-7B (its config.json): 32 layers, hidden 4096, MLP 11008, 32 heads of 128 (no GQA), vocab 32000
LAYERS, HIDDEN, FFN, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB, PARAMS = 32, 4096, 11008, 32, 32, 128, 32000, 6_738_415_616
DTYPE_BYTES = 2  # bf16
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V of every layer: 512 KiB

MLP_CSV = "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
ATTENTION_CSV = "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/attention.csv"
LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)

# Published figures for attention when Vidur's attention.csv is absent.
# FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608), Fig. 5 "Attention forward speed, head dim 128
# (H100 80GB SXM5)", with causal mask, FlashAttention-3 bars: TFLOPs/s by sequence length. vLLM runs
# FA3 on Hopper (vllm/v1/attention/backends/fa_utils.py: get_flash_attn_version).
FA3_CAUSAL_TFLOPS = {512: 292, 1024: 423, 2048: 521, 4096: 579, 8192: 602, 16384: 616}
H100_HBM_BYTES_S = 3.35e12  # H100 SXM5 80GB datasheet
# Vidur's A100 decode-attention measurements (data/profiling/a100/attention.csv, commit acb95f6, 10240
# decode rows): time per layer = 19 µs + KV bytes / 1.64 TB/s, i.e. 80% of the A100 80GB's 2.04 TB/s.
DECODE_FIXED_S, DECODE_BW_EFFICIENCY = 19e-6, 0.80

# vLLM defaults (vllm 0.32 engine/arg_utils.py, an H100-class GPU of >= 70 GiB, OpenAI server), block size 16
MAX_BATCHED_TOKENS, MAX_SEQS, BLOCK_SIZE = 8192, 1024, 16
GPU_GIB, GPU_MEMORY_UTILIZATION = 79.18, 0.9  # an H100 80GB HBM3: torch reports 85,017,493,504 bytes
NON_KV_GIB = 2.5  # besides weights: peak activations of the 8192-token profile run, CUDA graphs, non-torch
LINK_BYTES_S = 400e9 / 8  # prefill to decode KV transfer: one 400 Gb/s RDMA NIC at line rate, no overlap

PREFILLS = (128, 256, 512, 1024, 2048, 4096, 8192)  # Llama-2 takes 4096 tokens; 8192 is one full step's budget
CHUNKS = ((2048, 2048),)  # (chunk, tokens already computed): a prompt split across steps
DECODE_BATCHES = (1, 4, 16, 64, 128, 256)
DECODE_CONTEXTS = (256, 1024, 4096)


def find(root: Path, rel: str) -> Path | None:
    for p in (root / rel, root / Path(rel).name, root):
        if p.is_file() and p.name == Path(rel).name:
            return p
    return None


def _rows(path: Path, **match: str) -> list[dict[str, str]]:
    with path.open() as f:
        return [r for r in csv.DictReader(f) if all(r.get(k, v) == v for k, v in match.items())]


def _ms(row: dict[str, str], op: str) -> float:
    return float(row[f"time_stats.{op}.median"]) / 1000


def read_layer_ops(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token counts and, for each, seconds of one layer's per-token operations, of the embedding lookup
    and of the MLP up-projection (TP 1 rows)."""
    rows = sorted(
        _rows(path, num_tensor_parallel_workers="1", n_embd=str(HIDDEN), n_expanded_embd=str(FFN)),
        key=lambda r: int(r["num_tokens"]),
    )
    if not rows:
        raise SystemExit(f"{path}: no TP-1 rows of a {HIDDEN}/{FFN} model")
    tokens = np.array([int(r["num_tokens"]) for r in rows], float)
    layer = np.array([sum(_ms(r, op) for op in LAYER_OPS) for r in rows])
    emb = np.array([_ms(r, "emb") for r in rows])
    up = np.array([_ms(r, "mlp_up_proj") for r in rows])
    return tokens, layer, emb, up


def per_tokens(tokens: np.ndarray, seconds: np.ndarray, n: float) -> float:
    """Interpolated time of n tokens; beyond the profiled range, proportional to n (saturated GEMMs)."""
    if n > tokens[-1]:
        return float(seconds[-1] * n / tokens[-1])
    return float(np.interp(n, tokens, seconds))


class PublishedAttention:
    """Attention time of one layer from the published figures above."""

    source = (
        "attention from published figures: FlashAttention-3 paper (arXiv:2407.08608) Fig. 5 causal "
        "hdim-128 H100 throughput; decode KV read at 80% of H100 SXM5 3.35 TB/s + 19 µs/layer (fitted "
        "to Vidur data/profiling/a100/attention.csv @ acb95f6)"
    )

    def prefill(self, n: int, done: int = 0) -> float:
        """A chunk of n prompt tokens after `done` computed ones, at the throughput of a done + n sequence."""
        lengths = sorted(FA3_CAUSAL_TFLOPS)
        tflops = np.interp(np.log2(done + n), np.log2(lengths), [FA3_CAUSAL_TFLOPS[k] for k in lengths])
        return 4 * Q_HEADS * HEAD_DIM * attention_pairs(done, n) / (tflops * 1e12)  # QK^T and PV, 2 FLOPs a MAC

    def decode(self, batch: int, context: int) -> float:
        kv_bytes = batch * context * KV_BYTES_PER_TOKEN / LAYERS
        return DECODE_FIXED_S + kv_bytes / (DECODE_BW_EFFICIENCY * H100_HBM_BYTES_S)


class VidurAttention:
    """Attention time of one layer from Vidur's attention.csv: a lone prompt's time interpolated over its
    profiled lengths (beyond them, in proportion to attention pairs); decode time affine in the batch
    and its KV tokens, by least squares."""

    def __init__(self, path: Path):
        rows = _rows(
            path,
            n_q_head=str(Q_HEADS),
            n_kv_head=str(KV_HEADS),
            n_embd=str(HIDDEN),
            num_tensor_parallel_workers="1",
            block_size=str(BLOCK_SIZE),
        )
        prefill = sorted(
            (int(r["prefill_chunk_size"]), _ms(r, "attn_prefill"))
            for r in rows
            if r["is_prefill"] == "True" and int(r["kv_cache_size"]) == 0 and r["batch_size"] == "1"
        )
        decode = [
            (int(r["batch_size"]), int(r["kv_cache_size"]), _ms(r, "attn_decode"))
            for r in rows
            if r["is_prefill"] != "True"
        ]
        if not prefill or len(decode) < 3:
            raise SystemExit(f"{path}: too few prefill or decode rows for this model")
        self.lengths, self.prefill_s = np.array([n for n, _ in prefill], float), np.array([t for _, t in prefill])
        a = np.array([[1.0, b, b * kv] for b, kv, _ in decode])
        self.decode_coef, *_ = np.linalg.lstsq(a, np.array([t for *_, t in decode]), rcond=None)
        self.source = f"attention from Vidur {ATTENTION_CSV}"

    def prefill(self, n: int, done: int = 0) -> float:
        """A chunk of n prompt tokens after `done` computed ones: a lone n-token prompt's time, scaled by
        the attention pairs."""
        last = int(self.lengths[-1])
        lone = (
            self.prefill_s[-1] * attention_pairs(0, n) / attention_pairs(0, last)
            if n > last
            else np.interp(n, self.lengths, self.prefill_s)
        )
        return float(lone * attention_pairs(done, n) / attention_pairs(0, n))

    def decode(self, batch: int, context: int) -> float:
        return float(self.decode_coef @ [1.0, batch, batch * context])


def kv_save(tokens: int) -> float:
    """Writing the new tokens' K and V of one layer into the cache (memory bound)."""
    return tokens * KV_BYTES_PER_TOKEN / LAYERS / (DECODE_BW_EFFICIENCY * H100_HBM_BYTES_S)


def kv_cache_blocks(
    gpu_gib: float = GPU_GIB,
    utilization: float = GPU_MEMORY_UTILIZATION,
    non_kv_gib: float = NON_KV_GIB,
    block_size: int = BLOCK_SIZE,
) -> int:
    """vLLM's KV blocks: what the memory budget leaves after the weights and the rest, in blocks."""
    free = (gpu_gib * utilization - non_kv_gib) * 2**30 - PARAMS * DTYPE_BYTES
    return int(free // (KV_BYTES_PER_TOKEN * block_size))


def points(mlp: Path, attention, kv_tokens: int) -> list[Point]:
    """Step times of the representative batches from the per-operation measurements."""
    tokens, layer, emb, up = read_layer_ops(mlp)

    def linear(n: int, logits: int) -> float:  # layers' per-token work, embedding, LM head on `logits` rows
        return (
            LAYERS * (per_tokens(tokens, layer, n) + kv_save(n))
            + per_tokens(tokens, emb, n)
            + per_tokens(tokens, up, logits) * VOCAB / (2 * FFN)
        )

    out: list[Point] = []
    for n in PREFILLS:
        out.append((f"prefill {n}", n, attention_pairs(0, n), 0, 0, linear(n, 1) + LAYERS * attention.prefill(n)))
    for c, done in CHUNKS:
        out.append(
            (
                f"chunk {c} after {done}",
                c,
                attention_pairs(done, c),
                0,
                0,
                linear(c, 1) + LAYERS * attention.prefill(c, done),
            )
        )
    for c in DECODE_CONTEXTS:
        for b in DECODE_BATCHES:
            if b * c <= kv_tokens:  # a batch that fits the KV cache
                out.append((f"decode {b} x {c}", 0, 0, b, b * c, linear(b, b) + LAYERS * attention.decode(b, c)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vidur", type=Path, required=True, help="a Vidur checkout or a folder with its CSVs")
    parser.add_argument("--out", type=Path, default=Path("sim/profiles/h100-llama2-7b.json"))
    parser.add_argument("--commit", default="", help="the Vidur commit the files come from (for `source`)")
    args = parser.parse_args(argv)
    mlp = find(args.vidur, MLP_CSV)
    if mlp is None:
        raise SystemExit(f"no {Path(MLP_CSV).name} under {args.vidur}")
    attention_csv = find(args.vidur, ATTENTION_CSV)
    attention = VidurAttention(attention_csv) if attention_csv else PublishedAttention()
    blocks = kv_cache_blocks()
    pts = points(mlp, attention, blocks * BLOCK_SIZE)
    at = f" @ {args.commit}" if args.commit else ""
    profile, fitted = fitted_profile(
        args.out.stem,
        pts,
        max_batched_tokens=MAX_BATCHED_TOKENS,
        max_seqs=MAX_SEQS,
        kv_blocks=blocks,
        block_size=BLOCK_SIZE,
        kv_transfer_token_s=KV_BYTES_PER_TOKEN / LINK_BYTES_S,
        source=(
            f"Llama-2-7B bf16 TP1 on one H100, vLLM-like: per-operation GPU times from github.com/microsoft/vidur"
            f"{at} {MLP_CSV} (x{LAYERS} layers); {attention.source}; fitted by `python -m llmesh_sim.gpu_profile`; "
            f"KV {blocks} blocks of {BLOCK_SIZE} ({GPU_GIB} GiB x {GPU_MEMORY_UTILIZATION} - weights - "
            f"{NON_KV_GIB} GiB); KV transfer {KV_BYTES_PER_TOKEN // 1024} KiB/token over 400 Gb/s RDMA"
        ),
    )
    write_profile(profile, [(what, t, f) for (what, *_, t), f in zip(pts, fitted)], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
