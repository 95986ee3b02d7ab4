"""The length predictor's training and evaluation on a small slice of the real data
(../shared/data): it completes, the split is by prompt, and the fine-tuned model beats
always predicting the median on the held-out slice."""

from __future__ import annotations

import pytest

from llmesh.lengths import EDGES, NUM_BUCKETS, bucket_label, bucket_of
from llmesh_lengthpred import data, model
from llmesh_lengthpred.train import run

pytestmark = pytest.mark.timeout(600)


def test_buckets_follow_uellm():
    assert [bucket_of(n) for n in (0, 7, 8, 15, 16, 1023, 1024, 2047, 2048, 10**6)] == [0, 0, 1, 1, 2, 7, 8, 8, 9, 9]
    assert NUM_BUCKETS == len(EDGES) + 1 == 10
    assert bucket_label(0) == "[0,8)" and bucket_label(9) == ">=2048"


def test_split_is_by_prompt():
    examples = data.load("gpt-4", len, limit_prompts=200)
    train, test = data.split_by_prompt(examples, 0.2, seed=0)
    assert train and test and not {e.prompt for e in train} & {e.prompt for e in test}
    assert len({e.source for e in examples}) > 1  # several generators of the family


def test_training_on_a_slice_beats_always_the_median(tmp_path):
    scores = {s.name: s for s in run("gpt-4", epochs=3, limit_prompts=400, out=tmp_path / "model", quiet=True)}
    assert set(scores) == {"always the median", "regression on prompt length",
                           "encoder, not fine-tuned, linear head", "MiniLM + LoRA, fine-tuned"}
    tuned, median = scores["MiniLM + LoRA, fine-tuned"], scores["always the median"]
    assert tuned.exact > median.exact and tuned.mae_tokens < median.mae_tokens
    assert (tmp_path / "model" / "adapter").is_dir() and (tmp_path / "model" / "head.pt").is_file()


def test_onnx_export_computes_what_torch_computes():
    """The ONNX graph is traced from one example's shapes: it must hold for other lengths and for
    padded batches (dynamic axes), before int8 changes anything."""
    import torch

    from llmesh_lengthpred.settings import ARTIFACT_DIR

    encoder = model.load(ARTIFACT_DIR)[0].encoder.merge_and_unload().eval()
    exported = model.OnnxEncoder(encoder, threads=1, int8=False)
    tokenizer = model.load_tokenizer()
    for prompts in (["Hi"], ["Write a haiku about autumn leaves falling on a quiet pond."],
                    ["short", "a longer prompt, padded beside the short one " * 4], ["word " * 300]):
        batch = model.encode(tokenizer, prompts, 64)
        with torch.no_grad():
            expected = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        got = exported(batch["input_ids"], batch["attention_mask"]).last_hidden_state
        assert got.shape == expected.shape
        # fp32 kernels of two runtimes round apart: onnxruntime 1.32 differs from torch by up to 1.8e-4 here (a
        # wrong export differs by tenths)
        assert torch.allclose(got, expected, atol=1e-3), float((got - expected).abs().max())
