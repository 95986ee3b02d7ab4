"""Output-length buckets (UELLM's): [0,8), [8,16), [16,32), ..., [1024,2048), >= 2048 tokens.

Shared by the length predictor, which tags requests with a bucket, and by whoever reads the tag.
"""

from __future__ import annotations

import math
import statistics

EDGES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # upper bounds of the bounded buckets
NUM_BUCKETS = len(EDGES) + 1


def bucket_of(tokens: int) -> int:
    for i, edge in enumerate(EDGES):
        if tokens < edge:
            return i
    return len(EDGES)


def bucket_label(bucket: int) -> str:
    low = 0 if bucket == 0 else EDGES[bucket - 1]
    return f">={low}" if bucket == len(EDGES) else f"[{low},{EDGES[bucket]})"


# A prompt is sent to the predictor cut to this many characters: the model reads its first tokens
# and the full length (counted in the part at hand, extrapolated by characters beyond it).
MAX_PROMPT_CHARS = 4096


# A running request's output is sent to the remaining-length model cut to its last this many
# characters, with its full length.
MAX_GENERATED_CHARS = 16384


def cut_prompt(text: str) -> tuple[str, int]:
    """The part of `text` a predictor reads, and the full length in characters."""
    return text[:MAX_PROMPT_CHARS], len(text)


def bucket_medians(lengths: list[int], fallback: list[float] | None = None, min_count: int = 1) -> list[float]:
    """Median length in each bucket; where fewer than `min_count` lengths fall in one, the
    `fallback` value or else the bucket's geometric middle."""
    out = []
    for b in range(NUM_BUCKETS):
        inside = [n for n in lengths if bucket_of(n) == b]
        if len(inside) >= min_count:
            out.append(float(statistics.median(inside)))
        elif fallback is not None:
            out.append(fallback[b])
        else:
            low, high = (EDGES[b - 1] if b else 1), (EDGES[b] if b < len(EDGES) else 2 * EDGES[-1])
            out.append(math.sqrt(low * high))
    return out
