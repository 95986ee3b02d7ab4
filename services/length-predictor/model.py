"""The tokenizer the length models count tokens with: WordPiece over the bert-base-uncased vocabulary
(vocab.txt here, Apache-2.0, as Google's BERT and sentence-transformers' all-MiniLM-L6-v2 ship it), lower-cased
as BERT's uncased models are, read by `tokenizers` (the generators' own tokenizers are not available offline;
on English text the counts are close to Llama's, not equal). tests/unit/test_length_vocabulary.py holds it to
the ids the models were trained with."""

from __future__ import annotations

from pathlib import Path

VOCABULARY = Path(__file__).with_name("vocab.txt")


def load_tokenizer():
    """The tokenizer, called as transformers' (ids and offsets of a batch of texts)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import PreTrainedTokenizerFast

    wordpiece = BertWordPieceTokenizer(str(VOCABULARY), lowercase=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]")
    tokenizer.model_max_length = 1 << 30  # lengths are counted in full
    return tokenizer
