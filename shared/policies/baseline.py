"""Baselines to compare the papers' policies against: what a plain load balancer does."""

from __future__ import annotations

from llmesh.policies.core import Policy, cheaper_of_two, in_turn, queued_tokens, request_load, uniform

# Load ties are broken by tokens in flight: a tiny weight that never outweighs one request's load.
_TOKENS_TIE_BREAK = 1e-9


def round_robin() -> Policy:
    """Each request to the next worker in turn (among those with room)."""
    return Policy("round_robin", picker=in_turn)


def random_choice() -> Policy:
    """Each request to a worker chosen uniformly at random (among those with room)."""
    return Policy("random", picker=uniform)


def least_loaded() -> Policy:
    """The lowest load (requests held or on their way, relative to capacity), then the fewest
    tokens in flight; remaining ties at random."""
    return Policy("least_loaded", costs=((1.0, request_load), (_TOKENS_TIE_BREAK, queued_tokens)))


def power_of_two() -> Policy:
    """Power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized Load
    Balancing", 2001; vllm-router's `power_of_two`): two workers at random, the less loaded one."""
    return Policy(
        "power_of_two", costs=((1.0, request_load), (_TOKENS_TIE_BREAK, queued_tokens)), picker=cheaper_of_two
    )
