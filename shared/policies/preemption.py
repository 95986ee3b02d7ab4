"""A preempted request's KV when it resumes: reload it from the kv-store (swap) or let the engine
compute it again (recompute), whichever costs less (AdaptiveLLM).

Swapping costs the blocks' bytes over the store's load bandwidth; recomputing costs the tokens over
the engine's prefill throughput. Both rates are what the engine measured (`RateEstimate`), so the
choice follows the machine: a fast store or a long context swaps, a slow store or a fast GPU
recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Choice = Literal["swap", "recompute"]
CHOICES: tuple[Choice, ...] = ("swap", "recompute")


@dataclass
class RateEstimate:
    """A running mean (exponentially weighted) of amount per second, starting from a prior."""

    per_s: float
    weight: float = 0.25  # of the newest observation
    observed: int = 0

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.per_s = rate if not self.observed else (1 - self.weight) * self.per_s + self.weight * rate
        self.observed += 1


@dataclass(frozen=True)
class PreemptionCost:
    choice: Choice
    swap_s: float  # estimated time to load the blocks
    recompute_s: float  # estimated time to compute the tokens again


def swap_or_recompute(
    tokens: int,
    nbytes: int,
    load_bytes_per_s: float,
    prefill_tokens_per_s: float,
    mode: Literal["auto", "swap", "recompute"] = "auto",
) -> PreemptionCost:
    """Load `nbytes` holding `tokens` tokens' KV, or compute those tokens again: the cheaper
    (ties swap: it is exact by construction), unless `mode` fixes the choice."""
    if load_bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
        raise ValueError("rates must be positive")
    swap_s, recompute_s = nbytes / load_bytes_per_s, tokens / prefill_tokens_per_s
    choice: Choice = mode if mode != "auto" else "swap" if swap_s <= recompute_s else "recompute"
    return PreemptionCost(choice, swap_s, recompute_s)
