"""The H100 profile's fit (llmesh_sim.gpu_profile, with llmesh_sim.calibrate's fit) on synthetic measurements,
and the committed profile."""

import csv
import json
from pathlib import Path

import pytest

from llmesh_sim import gpu_profile as gp
from llmesh_sim.__main__ import load_profile
from llmesh_sim.calibrate import Point, fit_step_time
from llmesh_sim.engine import attention_pairs

PROFILE = Path(__file__).resolve().parents[2] / "sim" / "profiles" / "h100-llama2-7b.json"
TRUE = [0.005, 2e-5, 1e-9, 1e-5, 2e-7]  # base, per prompt token, per pair, per decoding request, per context token


def _point(label: str, n: int, done: int, b: int, ctx: int, coef=TRUE) -> Point:
    pairs = attention_pairs(done, n) if n else 0
    return label, n, pairs, b, ctx, coef[0] + coef[1] * n + coef[2] * pairs + coef[3] * b + coef[4] * ctx


def test_fit_recovers_an_affine_step_time():
    pts = [_point(f"prefill {n}", n, 0, 0, 0) for n in (128, 512, 2048, 8192)]
    pts += [_point("chunk", 2048, 2048, 0, 0)]
    pts += [_point(f"decode {b}x{c}", 0, 0, b, b * c) for b in (1, 16, 128) for c in (256, 4096)]
    coef, fitted = fit_step_time(pts)
    assert coef == pytest.approx([*TRUE, 0.0], rel=1e-6)
    assert fitted == pytest.approx([t for *_, t in pts], rel=1e-9)


def test_fit_keeps_coefficients_non_negative():
    """Decode steps that get faster with more context would need a negative per-context cost: it is
    dropped to 0 and the rest refitted."""
    pts = [_point(f"prefill {n}", n, 0, 0, 0) for n in (256, 1024, 4096)]
    pts += [
        (f"decode {b}x{c}", 0, 0, b, b * c, 0.005 + 1e-5 * b - 1e-8 * b * c) for b in (1, 8, 64) for c in (256, 1024)
    ]
    coef, _ = fit_step_time(pts)
    assert min(coef) >= 0 and coef[4] == 0


def test_fit_separates_a_fixed_path_to_the_first_token():
    """Times to first token measured from submission carry a fixed 8 ms that decode steps do not."""
    pts = [_point(f"prefill {n}", n, 0, 0, 0) for n in (64, 256, 1024, 2048)]
    pts = [(label, n, pairs, b, ctx, t + 0.008) for label, n, pairs, b, ctx, t in pts]
    pts += [_point(f"decode {b}x{c}", 0, 0, b, b * c) for b in (1, 16, 128) for c in (256, 4096)]
    coef, _ = fit_step_time(pts, first_token=True)
    assert coef == pytest.approx([*TRUE, 0.008], rel=1e-6)


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_main_on_synthetic_vidur_files(tmp_path, capsys):
    """Vidur-shaped CSVs whose times are affine in the step model's features (no fixed decode cost): the fit is exact
    (the attention pairs' coefficient is the layers times the per-layer one) and writes a loadable profile."""
    per_pair_ms = 3e-8  # ms per attention pair, per layer
    mlp = []
    for tp in ("1", "2"):
        for n in (1, 2, 4, 8, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
            row = {f"time_stats.{op}.median": 0.001 + 1e-6 * n for op in gp.LAYER_OPS}
            row |= {
                "time_stats.emb.median": 1e-6 * n,
                "n_embd": gp.HIDDEN,
                "n_expanded_embd": gp.FFN,
                "num_tensor_parallel_workers": tp,
                "num_tokens": n,
            }
            mlp.append(row)
    _write(tmp_path / gp.MLP_CSV, mlp)
    common = {
        "n_embd": gp.HIDDEN,
        "n_q_head": gp.Q_HEADS,
        "n_kv_head": gp.KV_HEADS,
        "block_size": gp.BLOCK_SIZE,
        "num_tensor_parallel_workers": 1,
    }
    attention = [
        common
        | {
            "batch_size": 1,
            "prefill_chunk_size": n,
            "kv_cache_size": 0,
            "is_prefill": True,
            "time_stats.attn_prefill.median": per_pair_ms * attention_pairs(0, n),
            "time_stats.attn_decode.median": "",
        }
        for n in (64, *gp.PREFILLS)
    ]
    attention += [
        common
        | {
            "batch_size": b,
            "prefill_chunk_size": 0,
            "kv_cache_size": c,
            "is_prefill": False,
            "time_stats.attn_prefill.median": "",
            "time_stats.attn_decode.median": 1e-4 * b + 1e-6 * b * c,
        }
        for b in (1, 8, 64)
        for c in (128, 2048)
    ]
    _write(tmp_path / gp.ATTENTION_CSV, attention)
    out = tmp_path / "h100-synthetic.json"
    assert gp.main(["--vidur", str(tmp_path), "--out", str(out), "--commit", "abc123"]) == 0
    assert "| prefill 2048 |" in capsys.readouterr().out
    profile = load_profile(out)
    assert profile.prefill_attention_s == pytest.approx(gp.LAYERS * per_pair_ms / 1000, rel=1e-6)
    assert profile.context_token_s > 0 and profile.kv_blocks == gp.kv_cache_blocks()
    assert "abc123" in profile.source and "attention from Vidur" in profile.source
    assert json.loads(out.read_text())["fit_worst_error"] < 1e-4


def test_kv_cache_of_an_h100():
    """512 KiB of KV a token (32 layers x K,V x 4096 x bf16): some 115k tokens in 90% of 80 GB."""
    assert gp.KV_BYTES_PER_TOKEN == 512 * 1024
    tokens = gp.kv_cache_blocks() * gp.BLOCK_SIZE
    assert 100_000 < tokens < 125_000


def test_committed_profile_is_plausible():
    p = load_profile(PROFILE)
    assert "microsoft/vidur" in p.source and p.block_size == 16 and p.max_batched_tokens == 8192
    assert 0.005 < p.step_s(0, 1, 1024) < 0.030  # one request decoding: a token in 5-30 ms
    assert 0.015 < p.step_s(0, 128, 128 * 1024) < 0.060  # 128 of them at 1k context
    assert 0.020 < p.prefill_s(2048) < 0.200  # Vidur's measurements give ~43 ms
    assert p.prefill_s(512) < p.prefill_s(2048) < p.prefill_s(4096) < 0.250
    assert 5e-6 < p.kv_transfer_token_s < 2e-5  # 512 KiB over 400 Gb/s: 10.5 µs a token


def test_attention_rows_of_another_layer_are_scaled_to_the_target(tmp_path):
    """The A100 13B target reads Llama-2-70B's TP-2 attention rows (32 query and 4 KV heads a GPU): its
    40-head prefill computes 40/32 of theirs, its decode reads 40/4 of their KV a token."""
    target = gp.TARGETS["a100-llama2-13b"]
    shape = {"n_embd": 8192, "n_q_head": 64, "n_kv_head": 8, "block_size": 16, "num_tensor_parallel_workers": 2}
    rows = [
        shape
        | {"batch_size": 1, "prefill_chunk_size": n, "kv_cache_size": 0, "is_prefill": True}
        | {"time_stats.attn_prefill.median": 0.001 * n, "time_stats.attn_decode.median": ""}
        for n in (64, 1024, 4096)
    ]
    rows += [
        shape
        | {"batch_size": b, "prefill_chunk_size": 0, "kv_cache_size": c, "is_prefill": False}
        | {"time_stats.attn_prefill.median": "", "time_stats.attn_decode.median": 0.02 + 1e-4 * b + 1e-7 * b * c}
        for b in (1, 8, 64)
        for c in (128, 2048)
    ]
    _write(tmp_path / "attention.csv", rows)
    attention = gp.VidurAttention(tmp_path / "attention.csv", target)
    assert attention.prefill(1024) == pytest.approx(1.25 * 1024e-6)
    assert attention.decode(8, 2048) == pytest.approx((0.02 + 8e-4 + 10 * 1e-7 * 8 * 2048) / 1000)
    assert "x1.25 (query heads)" in attention.source and "x10 (KV heads)" in attention.source


def test_committed_a100_13b_profile_is_plausible():
    p = load_profile(PROFILE.with_name("a100-llama2-13b.json"))
    assert p.kv_blocks * p.block_size * gp.LLAMA2_13B.kv_bytes_per_token < 55 * 2**30  # what 26 GB of weights leave
    assert 0.010 < p.step_s(0, 1, 1024) < 0.040  # a 13B decode step reads 26 GB at ~2 TB/s
    assert 0.150 < p.prefill_s(2048) < 0.400  # 53 TFLOP at 40-70% of 312 TFLOP/s
    assert p.prefill_s(2048) > 4 * load_profile(PROFILE).prefill_s(2048)  # twice the model on a third of the GPU
