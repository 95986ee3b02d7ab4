"""Fit the simulator's engine model to published per-operation GPU measurements (Microsoft Vidur).

    .venv/bin/python -m llmesh_sim.gpu_profile --vidur PATH [--target h100-llama2-7b] [--out sim/profiles/<target>.json]

PATH is a checkout of github.com/microsoft/vidur, or a folder holding the target's `mlp.csv` (and
`attention.csv`). Vidur profiled each operation of a transformer layer on one GPU and predicts a
batch's time as the number of layers times the sum of its operations' GPU times. This does the same
for representative batches: a lone prompt of n tokens (one prefill step, as vLLM runs it with chunked
prefill up to `max_num_batched_tokens`) and B requests decoding at a context of c tokens; then fits
`EngineProfile`'s step time by least squares on relative error, prints each batch beside the fit and
writes the profile. Targets (`TARGETS`):

- `h100-llama2-7b`: Llama-2-7B on one H100 (TP 1, bf16). The per-token operations (norms, QKV/O
  projections, rotary, MLP, residual adds) from Vidur's H100 `mlp.csv` of that model. Attention from its
  `attention.csv` when it is there; where it is not (the public snapshot this profile was made from lists
  the H100 file but lacks its contents), from published figures: FlashAttention-3's causal forward
  throughput on an H100 SXM5 (head dim 128), and decode attention as the KV cache read at the H100's
  HBM bandwidth with the efficiency and fixed time that Vidur's own decode-attention measurements (A100)
  show.
- `a100-llama2-13b`: Llama-2-13B on one A100 80GB (TP 1, bf16), for BanaServe's setup. Vidur has no
  13B model in its current tree; its earlier A100 `mlp.csv` (commit 7f14d6a, `data/profiling/a100/mlp.csv`)
  holds rows of the 5120/13824, 40-head gated-MLP layer that Llama-2-13B shares with InternLM-20B: those,
  times 40 layers (the rows leave the residual add empty: left out). Attention from Vidur's earlier A100
  `attention.csv` (commit acb95f6), measured on Llama-2-70B at TP 2 (32 query and 4 KV heads a GPU,
  head dim 128): prefill scaled by the query heads (40 / 32), decode by the KV bytes (40 / 4). Get them
  with `git show 7f14d6a:data/profiling/a100/mlp.csv > DIR/mlp.csv` and
  `git show acb95f6:data/profiling/a100/attention.csv > DIR/attention.csv`, then `--vidur DIR`.

The LM head (Vidur leaves it out) is scaled from the measured MLP up-projection, a GEMM of the same
depth. CPU time per step (scheduling, input preparation) is not modelled, as in Vidur's default.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .calibrate import Point, fitted_profile, write_profile
from .engine import attention_pairs

DTYPE_BYTES = 2  # bf16


@dataclass(frozen=True)
class Model:
    """A decoder's shape, from its config.json."""

    name: str
    layers: int
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES


LLAMA2_7B = Model("Llama-2-7B", 32, 4096, 11008, 32, 32, 128, 32000, 6_738_415_616)
LLAMA2_13B = Model("Llama-2-13B", 40, 5120, 13824, 40, 40, 128, 32000, 13_015_864_320)


@dataclass(frozen=True)
class AttentionRows:
    """Which rows of an attention.csv measure the attention used: a layer of `q_heads` query and `kv_heads`
    KV heads over `tp` GPUs, in a model of width `hidden` (the target's own layer at TP 1 when None)."""

    hidden: int
    q_heads: int
    kv_heads: int
    tp: int = 1


@dataclass(frozen=True)
class Target:
    """A model on a GPU, with where its measurements come from."""

    name: str
    model: Model
    gpu: str
    gpu_gib: float  # what torch reports of its memory
    hbm_bytes_s: float  # its datasheet's memory bandwidth
    mlp_csv: str  # path in a Vidur checkout
    attention_csv: str
    attention_rows: AttentionRows | None = None  # None: the target's own layer
    mlp_rows_note: str = ""  # what the source says of the MLP rows beyond their path
    ops_missing: tuple[str, ...] = field(default=())  # layer operations the rows leave empty


TARGETS = {
    t.name: t
    for t in (
        Target(
            "h100-llama2-7b",
            LLAMA2_7B,
            "H100",
            79.18,  # an H100 80GB HBM3: torch reports 85,017,493,504 bytes
            3.35e12,  # H100 SXM5 80GB datasheet
            "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv",
            "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/attention.csv",
        ),
        Target(
            "a100-llama2-13b",
            LLAMA2_13B,
            "A100 80GB",
            79.18,  # taken as the H100's: both are 80 GB HBM parts
            2.039e12,  # A100 80GB SXM datasheet
            "data/profiling/a100/mlp.csv",
            "data/profiling/a100/attention.csv",
            attention_rows=AttentionRows(8192, 64, 8, 2),
            mlp_rows_note=" @ 7f14d6a, the 5120/13824 40-head rows (InternLM-20B's layer, Llama-2-13B's shape)",
            ops_missing=("add",),
        ),
    )
}
H100 = TARGETS["h100-llama2-7b"]

# The H100 Llama-2-7B target's shape, as names (sim.prism sizes its GPUs by them)
LAYERS, HIDDEN, FFN, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB, PARAMS = (
    getattr(LLAMA2_7B, f) for f in ("layers", "hidden", "ffn", "q_heads", "kv_heads", "head_dim", "vocab", "params")
)
KV_BYTES_PER_TOKEN = LLAMA2_7B.kv_bytes_per_token  # 512 KiB
MLP_CSV, ATTENTION_CSV = H100.mlp_csv, H100.attention_csv
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
# Vidur's A100 decode-attention measurements (data/profiling/a100/attention.csv, commit acb95f6, 10240
# decode rows): time per layer = 19 µs + KV bytes / 1.64 TB/s, i.e. 80% of the A100 80GB's 2.04 TB/s.
DECODE_FIXED_S, DECODE_BW_EFFICIENCY = 19e-6, 0.80

# vLLM defaults (vllm 0.32 engine/arg_utils.py, a GPU of >= 70 GiB, OpenAI server), block size 16
MAX_BATCHED_TOKENS, MAX_SEQS, BLOCK_SIZE = 8192, 1024, 16
GPU_GIB, GPU_MEMORY_UTILIZATION = H100.gpu_gib, 0.9
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


def read_layer_ops(path: Path, target: Target = H100) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token counts and, for each, seconds of one layer's per-token operations, of the embedding lookup
    and of the MLP up-projection (TP 1 rows of the target's layer)."""
    m = target.model
    rows = sorted(
        _rows(path, num_tensor_parallel_workers="1", n_embd=str(m.hidden), n_expanded_embd=str(m.ffn)),
        key=lambda r: int(r["num_tokens"]),
    )
    if not rows:
        raise SystemExit(f"{path}: no TP-1 rows of a {m.hidden}/{m.ffn} model")
    tokens = np.array([int(r["num_tokens"]) for r in rows], float)
    ops = [op for op in LAYER_OPS if op not in target.ops_missing]
    layer = np.array([sum(_ms(r, op) for op in ops) for r in rows])
    emb = np.array([_ms(r, "emb") for r in rows])
    up = np.array([_ms(r, "mlp_up_proj") for r in rows])
    return tokens, layer, emb, up


def per_tokens(tokens: np.ndarray, seconds: np.ndarray, n: float) -> float:
    """Interpolated time of n tokens; beyond the profiled range, proportional to n (saturated GEMMs)."""
    if n > tokens[-1]:
        return float(seconds[-1] * n / tokens[-1])
    return float(np.interp(n, tokens, seconds))


class PublishedAttention:
    """Attention time of one H100 layer from the published figures above."""

    source = (
        "attention from published figures: FlashAttention-3 paper (arXiv:2407.08608) Fig. 5 causal "
        "hdim-128 H100 throughput; decode KV read at 80% of H100 SXM5 3.35 TB/s + 19 µs/layer (fitted "
        "to Vidur data/profiling/a100/attention.csv @ acb95f6)"
    )

    def __init__(self, target: Target = H100):
        self.model, self.hbm_bytes_s = target.model, target.hbm_bytes_s

    def prefill(self, n: int, done: int = 0) -> float:
        """A chunk of n prompt tokens after `done` computed ones, at the throughput of a done + n sequence."""
        lengths = sorted(FA3_CAUSAL_TFLOPS)
        tflops = np.interp(np.log2(done + n), np.log2(lengths), [FA3_CAUSAL_TFLOPS[k] for k in lengths])
        m = self.model
        return 4 * m.q_heads * m.head_dim * attention_pairs(done, n) / (tflops * 1e12)  # QK^T and PV, 2 FLOPs a MAC

    def decode(self, batch: int, context: int) -> float:
        kv_bytes = batch * context * self.model.kv_bytes_per_token / self.model.layers
        return DECODE_FIXED_S + kv_bytes / (DECODE_BW_EFFICIENCY * self.hbm_bytes_s)


class VidurAttention:
    """Attention time of one layer from Vidur's attention.csv: a lone prompt's time interpolated over its
    profiled lengths (beyond them, in proportion to attention pairs); decode time affine in the batch
    and its KV tokens, by least squares. Rows of another layer (`Target.attention_rows`) are scaled to the
    target's: prefill by the query heads a GPU computes, decode's per-token term by the KV heads it reads."""

    def __init__(self, path: Path, target: Target = H100):
        m = target.model
        shape = target.attention_rows or AttentionRows(m.hidden, m.q_heads, m.kv_heads)
        rows = _rows(
            path,
            n_q_head=str(shape.q_heads),
            n_kv_head=str(shape.kv_heads),
            n_embd=str(shape.hidden),
            num_tensor_parallel_workers=str(shape.tp),
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
        q_scale = m.q_heads / (shape.q_heads / shape.tp)
        kv_scale = m.kv_heads / (shape.kv_heads / shape.tp)
        self.lengths = np.array([n for n, _ in prefill], float)
        self.prefill_s = np.array([t for _, t in prefill]) * q_scale
        a = np.array([[1.0, b, b * kv] for b, kv, _ in decode])
        coef, *_ = np.linalg.lstsq(a, np.array([t for *_, t in decode]), rcond=None)
        self.decode_coef = coef * [1.0, 1.0, kv_scale]
        self.source = f"attention from Vidur {target.attention_csv}"
        if target.attention_rows is not None:
            self.source += (
                f" @ acb95f6, its {shape.q_heads}-query/{shape.kv_heads}-KV-head TP-{shape.tp} rows "
                f"(Llama-2-70B), prefill x{q_scale:g} (query heads), decode's KV term x{kv_scale:g} (KV heads)"
            )

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


def kv_save(tokens: int, target: Target = H100) -> float:
    """Writing the new tokens' K and V of one layer into the cache (memory bound)."""
    m = target.model
    return tokens * m.kv_bytes_per_token / m.layers / (DECODE_BW_EFFICIENCY * target.hbm_bytes_s)


def kv_cache_blocks(
    gpu_gib: float = GPU_GIB,
    utilization: float = GPU_MEMORY_UTILIZATION,
    non_kv_gib: float = NON_KV_GIB,
    block_size: int = BLOCK_SIZE,
    model: Model = LLAMA2_7B,
) -> int:
    """vLLM's KV blocks: what the memory budget leaves after the weights and the rest, in blocks."""
    free = (gpu_gib * utilization - non_kv_gib) * 2**30 - model.params * DTYPE_BYTES
    return int(free // (model.kv_bytes_per_token * block_size))


def points(mlp: Path, attention, kv_tokens: int, target: Target = H100) -> list[Point]:
    """Step times of the representative batches from the per-operation measurements."""
    tokens, layer, emb, up = read_layer_ops(mlp, target)
    m = target.model

    def linear(n: int, logits: int) -> float:  # layers' per-token work, embedding, LM head on `logits` rows
        return (
            m.layers * (per_tokens(tokens, layer, n) + kv_save(n, target))
            + per_tokens(tokens, emb, n)
            + per_tokens(tokens, up, logits) * m.vocab / (2 * m.ffn)
        )

    out: list[Point] = []
    for n in PREFILLS:
        out.append((f"prefill {n}", n, attention_pairs(0, n), 0, 0, linear(n, 1) + m.layers * attention.prefill(n)))
    for c, done in CHUNKS:
        out.append(
            (
                f"chunk {c} after {done}",
                c,
                attention_pairs(done, c),
                0,
                0,
                linear(c, 1) + m.layers * attention.prefill(c, done),
            )
        )
    for c in DECODE_CONTEXTS:
        for b in DECODE_BATCHES:
            if b * c <= kv_tokens:  # a batch that fits the KV cache
                out.append((f"decode {b} x {c}", 0, 0, b, b * c, linear(b, b) + m.layers * attention.decode(b, c)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vidur", type=Path, required=True, help="a Vidur checkout or a folder with its CSVs")
    parser.add_argument("--target", choices=sorted(TARGETS), default=H100.name)
    parser.add_argument("--out", type=Path, help="default: sim/profiles/<target>.json")
    parser.add_argument("--commit", default="", help="the Vidur commit the files come from (for `source`)")
    args = parser.parse_args(argv)
    target = TARGETS[args.target]
    out = args.out or Path("sim/profiles") / f"{target.name}.json"
    m = target.model
    mlp = find(args.vidur, target.mlp_csv)
    if mlp is None:
        raise SystemExit(f"no {Path(target.mlp_csv).name} under {args.vidur}")
    attention_csv = find(args.vidur, target.attention_csv)
    attention: VidurAttention | PublishedAttention
    if attention_csv is not None:
        attention = VidurAttention(attention_csv, target)
    elif target is H100:
        attention = PublishedAttention(target)
    else:
        raise SystemExit(f"no {Path(target.attention_csv).name} under {args.vidur}")
    blocks = kv_cache_blocks(target.gpu_gib, model=m)
    pts = points(mlp, attention, blocks * BLOCK_SIZE, target)
    at = f" @ {args.commit}" if args.commit else ""
    profile, fitted = fitted_profile(
        out.stem,
        pts,
        max_batched_tokens=MAX_BATCHED_TOKENS,
        max_seqs=MAX_SEQS,
        kv_blocks=blocks,
        block_size=BLOCK_SIZE,
        kv_transfer_token_s=m.kv_bytes_per_token / LINK_BYTES_S,
        source=(
            f"{m.name} bf16 TP1 on one {target.gpu}, vLLM-like: per-operation GPU times from "
            f"github.com/microsoft/vidur{at} {target.mlp_csv}{target.mlp_rows_note} (x{m.layers} layers"
            f"{''.join(f'; no {op}' for op in target.ops_missing)}); {attention.source}; fitted by "
            f"`python -m llmesh_sim.gpu_profile`; KV {blocks} blocks of {BLOCK_SIZE} ({target.gpu_gib} GiB x "
            f"{GPU_MEMORY_UTILIZATION} - weights - {NON_KV_GIB} GiB); KV transfer "
            f"{m.kv_bytes_per_token // 1024} KiB/token over 400 Gb/s RDMA"
        ),
    )
    write_profile(profile, [(what, t, f) for (what, *_, t), f in zip(pts, fitted)], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
