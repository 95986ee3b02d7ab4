"""Embedded random-weight Llama models, built locally so nothing is downloaded.

`resolve_model(name, model_dir)` turns an embedded name into a folder (building it on
first use, under a file lock so concurrent workers build it once), a folder's name into that
folder of `model_dir` (a host's weights, mounted there), and passes any other name through to
vLLM unchanged (a local path or a hub name on GPU hosts).
"""

from __future__ import annotations

import fcntl
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "llmesh/tiny-llama": (256, 4, 8, 4, 512),
    "llmesh/small-llama": (1024, 8, 16, 8, 2816),
    "llmesh/tiny-llama-b": (256, 4, 8, 4, 512),  # tiny-llama's shapes and tokenizer, other weights
    "llmesh/tiny-llama-c": (256, 4, 8, 4, 512),  # and a third set
}
VOCAB_SIZE = 2000
SEED = 1234
SEEDS = {"llmesh/tiny-llama-b": 4321, "llmesh/tiny-llama-c": 9876}  # the weights' seed, where not SEED
# a tool-use template's parts, kept plain: tools as a system turn, an assistant's calls as JSON
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{{ m['tool_calls'] | map(attribute='function') | list | tojson }}{% endif %}"
    "{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# a reasoning model's markers (DeepSeek-R1's and Qwen3's, shown as text): added after the trained vocabulary, with
# weights that keep every other token's logits and make them never the likeliest (`build_model`)
THINK_TOKENS = ["<think>", "</think>"]
BUILD = 2  # what a model built by an earlier version lacks, it is built again for (2: THINK_TOKENS)
BUILD_FILE = "llmesh-build.json"


def cpu_dtype() -> str:
    """The dtype an engine on this CPU computes fastest: bfloat16 where the CPU has it natively (AVX-512 BF16 or
    AMX), float32 where it emulates bf16 (AVX2 alone: a decode step of tiny-llama 1.2x float32's at batch 1, 1.6x
    at 8; a 1k-hidden model's GEMMs ~1% of float32's speed)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "bfloat16"
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def resolve_model(name: str, model_dir: Path) -> str:
    """The folder or hub name vLLM loads for the model `name`: an embedded model's folder, built if need be; a
    folder of that name in `model_dir`; else `name` itself (a path, or a hub name)."""
    if name not in EMBEDDED:
        local = Path(model_dir) / name
        return str(local) if not Path(name).is_absolute() and local.is_dir() else name
    target = Path(model_dir) / name.split("/", 1)[1]
    if _built(target):
        _current_chat_template(target)
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(target):
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
            old = target.with_name(f".{target.name}-old-{os.getpid()}")
            try:
                build_model(tmp, *EMBEDDED[name], seed=SEEDS.get(name, SEED))
                tmp.chmod(0o755)
                if target.exists():  # an earlier version's build
                    target.rename(old)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
    return str(target)


def _built(target: Path) -> bool:
    """Whether `target` holds a model built by this version (or a later one)."""
    try:
        return json.loads((target / BUILD_FILE).read_text())["build"] >= BUILD
    except (OSError, ValueError, KeyError):
        return False


def _current_chat_template(target: Path) -> None:
    """A model built by an earlier version gets this version's chat template (the weights stay)."""
    path = target / "chat_template.jinja"
    if path.exists() and path.read_text() != CHAT_TEMPLATE:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(CHAT_TEMPLATE)
        tmp.replace(path)


def _corpus() -> list[str]:
    """Deterministic English-ish training text: docstrings of standard-library modules."""
    import argparse  # noqa: E401
    import asyncio
    import collections
    import json
    import logging
    import pathlib
    import re
    import string
    import textwrap
    import unittest

    texts = []
    for mod in (argparse, asyncio, collections, json, logging, pathlib, re, string, textwrap, unittest):
        for _, obj in sorted(vars(mod).items()):
            doc = inspect.getdoc(obj)
            if doc:
                texts.append(doc)
    return texts


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.add_tokens(THINK_TOKENS)  # (ids VOCAB_SIZE on)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_model(
    path: Path, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seed: int = SEED
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(path)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        initializer_range=0.1,  # larger than usual so greedy output depends visibly on context
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # THINK_TOKENS: each row the mean of the trained ones, so every other token's weights (and logits) are as
    # without them, and theirs (a mean logit) never the likeliest: a model emits them where a logit_bias
    # lifts them (tests of reasoning parsers)
    means = [layer.weight.detach().mean(0) for layer in (model.model.embed_tokens, model.lm_head)]
    model.resize_token_embeddings(VOCAB_SIZE + len(THINK_TOKENS), mean_resizing=False)
    with torch.no_grad():
        for layer, mean in zip((model.model.embed_tokens, model.lm_head), means):
            layer.weight[VOCAB_SIZE:] = mean
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]  # @wraps'd `to`: stubs miss self
    model.save_pretrained(path, safe_serialization=True)
    (path / BUILD_FILE).write_text(json.dumps({"build": BUILD}))
