"""Prompts with the real length of their responses, from the public data under ../shared/data.

Output length depends on the model that answers, so examples are grouped by the family of
the generator (`FAMILIES`) and a predictor is trained for one family. Lengths are counted
with the encoder's own tokenizer (WordPiece, the bert-base-uncased vocabulary bundled with
all-MiniLM-L6-v2), since the generators' tokenizers are not available offline. Splits are by
prompt, never by row: every response to one prompt lands on the same side.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# ../shared/data beside the repository, or MESH_SHARED_DATA_DIR
DATA_DIR = Path(os.environ.get("MESH_SHARED_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")

# family -> (alpaca-eval result dirs, arena-hard v0.1 answer files); gpteacher's responses are GPT-4's
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama": (("Meta-Llama-3-8B-Instruct", "Meta-Llama-3-70B-Instruct", "Meta-Llama-3.1-8B-Instruct-Turbo",
               "Meta-Llama-3.1-70B-Instruct-Turbo", "llama-2-7b-chat-hf", "llama-2-13b-chat-hf",
               "llama-2-70b-chat-hf"), ()),
    "gpt-4": (("gpt4_1106_preview", "gpt-4o-2024-05-13", "gpt-4o-mini-2024-07-18"), ("gpt-4-0314", "gpt-4-0613")),
    "mistral": (("Mistral-7B-Instruct-v0.2", "Mistral-7B-Instruct-v0.3", "Mixtral-8x7B-Instruct-v0.1",
                 "Mixtral-8x22B-Instruct-v0.1"), ()),
}


@dataclass(frozen=True)
class Example:
    prompt: str
    output_tokens: int
    source: str  # "<dataset>/<generator>"


def _alpaca_eval(model: str) -> Iterator[tuple[str, str, str]]:
    for row in json.loads((DATA_DIR / "alpaca-eval" / "results" / model / "model_outputs.json").read_text()):
        yield row["instruction"], row["output"], f"alpaca-eval/{model}"


def _arena_hard(model: str) -> Iterator[tuple[str, str, str]]:
    path = DATA_DIR / "arena-hard" / "data" / "arena-hard-v0.1" / "model_answer" / f"{model}.jsonl"
    for line in path.read_text().splitlines():
        row = json.loads(line)
        user = next(m["content"] for m in row["messages"] if m["role"] == "user")
        answer = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
        yield user, answer["answer"] if isinstance(answer, dict) else answer, f"arena-hard/{model}"


def load(family: str, count_tokens: Callable[[str], int], limit_prompts: int | None = None) -> list[Example]:
    """Every (prompt, response length) of `family`; with `limit_prompts`, only that many prompts
    (chosen by hash, so the same ones each time)."""
    alpaca, arena = FAMILIES[family]
    rows = [r for m in alpaca for r in _alpaca_eval(m)] + [r for m in arena for r in _arena_hard(m)]
    if limit_prompts is not None:
        keep = set(sorted({p for p, _, _ in rows}, key=prompt_hash)[:limit_prompts])
        rows = [r for r in rows if r[0] in keep]
    return [Example(prompt, count_tokens(output), source) for prompt, output, source in rows if output]


def prompt_hash(prompt: str) -> str:
    return hashlib.sha1(prompt.encode()).hexdigest()


def split_by_prompt(examples: list[Example], test_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Train and test sets with no prompt in both."""
    def is_test(prompt: str) -> bool:
        digest = hashlib.sha1(f"{seed}:{prompt}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction

    train = [e for e in examples if not is_test(e.prompt)]
    test = [e for e in examples if is_test(e.prompt)]
    return train, test
