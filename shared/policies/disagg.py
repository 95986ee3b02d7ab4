"""Where a request's prompt is computed.

Disaggregated (the default): on a prefill worker, then decode elsewhere, so decode steps never
wait behind a prompt. But a single prefill queue is a bottleneck once prompts arrive faster than
one engine computes them, while the decode engines have room between their steps. Conditional
disaggregation (NVIDIA Dynamo's disaggregated router; BanaServe's load-aware dispatch between
prefill and decode capacity): run the whole request on a decode worker when that answers
sooner than the prefill queue by more than `margin_s`, the price being a stall of that worker's
other requests for the length of one prompt: no longer than its streams can absorb within
their time-per-output-token target (`stall_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamProgress:
    """A stream decoding on a worker, as its client sees it."""

    elapsed_s: float  # since its first token
    tokens: int  # sent so far
    remaining: int  # still to come, at most (0: unknown)


def stall_budget(streams: list[StreamProgress], tpot_slo_s: float, step_s: float | None = None) -> float:
    """The longest stall after which every stream in `streams` that can still meet `tpot_slo_s` per
    output token does: its remaining tokens each take `step_s`, the worker's time per decode step
    now (None: the stream's pace so far, or the others' mean for a stream without one yet; a
    pace carries the stream's earlier waits, a KV load or another stall, into its future).

    Streams past the target even without a stall are left out: a stall cannot cost their goodput,
    and counting them would keep every prompt off a busy worker. A stream of unknown length is
    taken to end now, the case where a stall weighs most. No streams: no limit."""
    paces = [s.elapsed_s / (s.tokens - 1) if s.tokens > 1 else None for s in streams]
    known = [p for p in paces if p is not None]
    default_pace = sum(known) / len(known) if known else 0.0
    budget = float("inf")
    for s, pace in zip(streams, paces):
        gaps = s.tokens + s.remaining - 1
        if gaps <= 0:
            continue
        step = step_s if step_s is not None else default_pace if pace is None else pace
        slack = tpot_slo_s * gaps - s.elapsed_s - s.remaining * step
        if slack >= 0:
            budget = min(budget, slack)
    return budget


@dataclass(frozen=True)
class PrefillSite:
    backlog_tokens: int  # prompt tokens it has yet to compute before a new one
    tokens_per_s: float  # prompt tokens it computes per second (0: not measured yet)


def prefill_locally(
    prompt_tokens: int,
    remote: PrefillSite,
    local: PrefillSite,
    margin_s: float | None,
    max_stall_s: float = float("inf"),
) -> bool:
    """True when the decode worker `local` would compute the prompt sooner than the prefill worker
    `remote` by more than `margin_s` (None: never), within `max_stall_s` of its own prefill work
    (the queue before it included: its decode streams wait that long; see `stall_budget`). An
    idle prefill worker always takes the prompt: this answers queueing, and without a queue the
    two measured speeds differ only by the prefill side's KV saving and noise. An unmeasured
    speed is taken to equal the other's (the same engine on the same hardware); with neither
    measured, disaggregate."""
    if margin_s is None or remote.backlog_tokens == 0:
        return False
    remote_rate = remote.tokens_per_s or local.tokens_per_s
    local_rate = local.tokens_per_s or remote.tokens_per_s
    if not remote_rate:
        return False
    remote_s = (remote.backlog_tokens + prompt_tokens) / remote_rate
    local_s = (local.backlog_tokens + prompt_tokens) / local_rate
    return local_s <= max_stall_s and local_s + margin_s < remote_s
