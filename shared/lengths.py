"""Output-length buckets (UELLM's): [0,8), [8,16), [16,32), ..., [1024,2048), >= 2048 tokens.

Shared by the length predictor, which tags requests with a bucket, and by whoever reads the tag.
"""

from __future__ import annotations

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
