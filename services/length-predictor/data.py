"""Prompts with the real responses to them, from every public set under ../shared/data that pairs
prompt text with response text.

    source        generators                                   prompts
    alpaca-eval   30 models (GPT-4, Claude, Llama, Mistral…)    805
    arena-hard    gpt-4-0314/0613, gpt-3.5-turbo, o3-mini,      500 (v0.1) + 750 (v2.0)
                  sky-t1-32b
    gpteacher     GPT-4 (role-play and tool-use prompts)        10,819
    hh-rlhf       Anthropic's 52B assistant (multi-turn)        2,312 dialogues, 2 answers each

ShareGPT is not here: its prompts (sharegpt-prompts-mlenergy) and its lengths (sarathi) come
without each other. Lengths are counted in WordPiece tokens (llmesh_lengthpred.model: the
bert-base-uncased vocabulary), since the generators' tokenizers are not available offline. A
generator's family (`family_of`) is a model input: the same prompt gets answers of very
different lengths from different models. Splits are by prompt, never by row: every response to
one prompt lands on the same side.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# ../shared/data beside the repository, or MESH_SHARED_DATA_DIR
DATA_DIR = Path(os.environ.get("MESH_SHARED_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")

SOURCES = ("alpaca-eval", "arena-hard", "gpteacher", "hh-rlhf")
UNKNOWN = "unknown"  # a generator or family the model has not seen

# generator name pattern -> family, first match wins
_FAMILY_PATTERNS = (
    ("llama", r"llama|vicuna|tulu|alpaca-7b"),
    ("gpt-4", r"gpt-?4|gpteacher"),
    ("gpt-3.5", r"gpt-3\.5|davinci"),
    ("o3", r"^o\d"),
    ("claude", r"claude|anthropic"),
    ("mistral", r"mistral|mixtral|zephyr"),
    ("qwen", r"qwen|sky-t1"),
    ("gemma", r"gemma"),
    ("yi", r"^yi-"),
    ("dbrx", r"dbrx"),
    ("deepseek", r"deepseek"),
)


def family_of(generator: str) -> str:
    name = generator.lower()
    return next((family for family, pattern in _FAMILY_PATTERNS if re.search(pattern, name)), UNKNOWN)


@dataclass(frozen=True)
class Example:
    prompt: str
    output_tokens: int
    source: str  # one of SOURCES, or "deployment" for what a running mesh observed
    generator: str = UNKNOWN
    response: str = ""

    @property
    def family(self) -> str:
        return family_of(self.generator)


def _alpaca_eval() -> Iterator[tuple[str, str, str]]:
    for results in sorted((DATA_DIR / "alpaca-eval" / "results").iterdir()):
        for row in json.loads((results / "model_outputs.json").read_text()):
            yield row["instruction"], row["output"], results.name


def _arena_hard() -> Iterator[tuple[str, str, str]]:
    for answers in sorted((DATA_DIR / "arena-hard" / "data").glob("arena-hard-v*/model_answer/*.jsonl")):
        for line in answers.read_text().split("\n"):
            if not line.strip():
                continue
            row = json.loads(line)
            user = next(m["content"] for m in row["messages"] if m["role"] == "user")
            answer = next(m["content"] for m in row["messages"] if m["role"] == "assistant")
            yield user, answer["answer"] if isinstance(answer, dict) else answer, answers.stem


def _gpteacher() -> Iterator[tuple[str, str, str]]:
    for name in ("roleplay-simple-deduped-roleplay-dataset.json", "toolformer-dedupe-only-dataset.json"):
        for row in json.loads((DATA_DIR / "gpteacher" / name).read_text()):
            prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
            yield prompt, row["output"], "gpteacher-gpt-4"


def _hh_rlhf() -> Iterator[tuple[str, str, str]]:
    with gzip.open(DATA_DIR / "hh-rlhf" / "harmless-base" / "test.jsonl.gz", "rt") as rows:
        for line in rows:
            row = json.loads(line)
            for dialogue in (row["chosen"], row["rejected"]):
                prompt, _, answer = dialogue.rpartition("\n\nAssistant:")
                yield prompt.strip(), answer.strip(), "anthropic-52b"


_LOADERS: dict[str, Callable[[], Iterator[tuple[str, str, str]]]] = {
    "alpaca-eval": _alpaca_eval,
    "arena-hard": _arena_hard,
    "gpteacher": _gpteacher,
    "hh-rlhf": _hh_rlhf,
}


def load(
    count_tokens: Callable[[list[str]], list[int]],
    sources: tuple[str, ...] = SOURCES,
    family: str | None = None,
    limit_prompts: int | None = None,
    keep_text: bool = False,
) -> list[Example]:
    """Every (prompt, response length) of `sources`, of one generator `family` if given; with
    `limit_prompts`, only that many prompts of each source (chosen by hash, so the same ones each
    time); with `keep_text`, the responses' text too."""
    out = []
    for source in sources:
        rows = [(p, r, g) for p, r, g in _LOADERS[source]() if r and (family is None or family_of(g) == family)]
        if limit_prompts is not None:
            keep = set(sorted({p for p, _, _ in rows}, key=prompt_hash)[:limit_prompts])
            rows = [row for row in rows if row[0] in keep]
        counts = count_tokens([r for _, r, _ in rows]) if rows else []
        out += [Example(p, n, source, g, r if keep_text else "") for (p, r, g), n in zip(rows, counts)]
    return out


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
