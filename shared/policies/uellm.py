"""UELLM's batch formation, SLO-ODBS, and that of its baseline S3, as the authors' code forms batches
(github.com/HYIUYOU/UELLM at 007c98f: UELM/UELM-batch/batch.py and UELM/S3/s3.py): requests known in
advance are cut into static batches that run one after another, each until its longest output.

The authors' code counts outputs in characters; here they are tokens, its constants converted at
CHARS_PER_TOKEN (its 0.3 per character is 1.2 per token, its padding limit of 15,000 characters 3,750
tokens, S3's 1,024 characters 256 tokens). A request without a prediction counts as output 0."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class BatchItem:
    slo_s: float  # the request's latency target: its whole answer, from the start of the run
    output_tokens: float | None  # its predicted output length (None: no prediction)


def _output(item: BatchItem) -> float:
    return item.output_tokens if item.output_tokens is not None else 0.0


def _cut(
    items: Sequence[BatchItem], order: Sequence[int], joins: Callable[[list[float], float], bool]
) -> list[list[int]]:
    """`order` cut into batches greedily: each request joins the open batch if `joins(its members' outputs,
    the request's output)`, otherwise it opens the next."""
    batches: list[list[int]] = []
    outputs: list[float] = []  # of the open batch's members
    for i in order:
        out = _output(items[i])
        if batches and joins(outputs, out):
            batches[-1].append(i)
            outputs.append(out)
        else:
            batches.append([i])
            outputs = [out]
    return batches


def slo_odbs_batches(
    items: Sequence[BatchItem],
    slo_weight: float = 1.0,
    output_weight: float = 0.3 * CHARS_PER_TOKEN,
    padding_limit: float = 15000 / CHARS_PER_TOKEN,
    max_batch: int = 10,
    parallel_overhead: float = 1.2,
) -> list[list[int]]:
    """SLO-ODBS: the requests (indices into `items`) in order of slo_weight·SLO + output_weight·output,
    the tightest and shortest first; each joins the open batch while that has fewer than `max_batch` and
    the padding it adds, (its output − the batch's longest so far) × (the batch's size with it) ×
    `parallel_overhead`, is at most `padding_limit`; otherwise it opens the next batch."""
    order = sorted(
        range(len(items)), key=lambda i: (slo_weight * items[i].slo_s + output_weight * _output(items[i]), i)
    )
    return _cut(
        items,
        order,
        lambda outs, out: (
            len(outs) < max_batch and (out - max(outs)) * (len(outs) + 1) * parallel_overhead <= padding_limit
        ),
    )


def s3_batches(
    items: Sequence[BatchItem], output_limit: float = 1024 / CHARS_PER_TOKEN, max_batch: int = 20
) -> list[list[int]]:
    """S3's batching as UELLM's baseline: the requests by predicted output, shortest first; each joins the
    open batch while that has fewer than `max_batch` and their outputs together stay within `output_limit`
    (S3's memory bound); otherwise it opens the next batch."""
    order = sorted(range(len(items)), key=lambda i: (_output(items[i]), i))
    return _cut(items, order, lambda outs, out: len(outs) < max_batch and sum(outs) + out <= output_limit)
