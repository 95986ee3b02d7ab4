"""Where a request's prompt is computed.

Disaggregated (the default): on a prefill worker, then decode elsewhere, so decode steps never
wait behind a prompt. But a single prefill queue is a bottleneck once prompts arrive faster than
one engine computes them, while the decode engines have room between their steps. Conditional
disaggregation (NVIDIA Dynamo's disaggregated router; BanaServe's load-aware dispatch between
prefill and decode capacity): run the whole request on a decode worker when that answers
sooner than the prefill queue by more than `margin_s`, the price being a stall of that worker's
other requests for the length of one prompt: bounded by `max_stall_s`, since a long prompt taken
whole would push every stream on the worker past its TPOT target.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillSite:
    backlog_tokens: int  # prompt tokens it has yet to compute before a new one
    tokens_per_s: float  # prompt tokens it computes per second (0: not measured yet)


def prefill_locally(prompt_tokens: int, remote: PrefillSite, local: PrefillSite, margin_s: float | None,
                    max_stall_s: float = float("inf")) -> bool:
    """True when the decode worker `local` would compute the prompt sooner than the prefill worker
    `remote` by more than `margin_s` (None: never), within `max_stall_s` of its own prefill work
    (the queue before it included: its decode streams wait that long). An idle prefill worker always takes the
    prompt: this answers queueing, and without a queue the two measured speeds differ only by
    the prefill side's KV saving and noise. An unmeasured speed is taken to equal the other's
    (the same engine on the same hardware); with neither measured, disaggregate."""
    if margin_s is None or remote.backlog_tokens == 0:
        return False
    remote_rate = remote.tokens_per_s or local.tokens_per_s
    local_rate = local.tokens_per_s or remote.tokens_per_s
    if not remote_rate:
        return False
    remote_s = (remote.backlog_tokens + prompt_tokens) / remote_rate
    local_s = (local.backlog_tokens + prompt_tokens) / local_rate
    return local_s <= max_stall_s and local_s + margin_s < remote_s
