"""Swap or recompute (llmesh.policies.preemption): the cheaper of the two measured costs."""

import pytest

from llmesh.policies.preemption import RateEstimate, swap_or_recompute

MB = 1e6


@pytest.mark.parametrize(
    ("tokens", "nbytes", "load_per_s", "tokens_per_s", "choice"),
    [
        (1024, 64 * MB, 10_000 * MB, 5_000, "swap"),  # a fast store: 6 ms to load vs 205 ms to compute
        (1024, 64 * MB, 100 * MB, 5_000, "recompute"),  # a slow store: 640 ms vs 205 ms
        (128, 8 * MB, 1_000 * MB, 100_000, "recompute"),  # a fast GPU on a short context: 1.3 ms vs 8 ms
        (100, 1 * MB, 1 * MB, 100, "swap"),  # equal: swap (exact by construction)
    ],
)
def test_the_cheaper_way(tokens, nbytes, load_per_s, tokens_per_s, choice):
    cost = swap_or_recompute(tokens, nbytes, load_per_s, tokens_per_s)
    assert cost.choice == choice
    assert cost.swap_s == pytest.approx(nbytes / load_per_s)
    assert cost.recompute_s == pytest.approx(tokens / tokens_per_s)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_fixed_mode_overrides_the_costs(mode):
    assert swap_or_recompute(1024, 64 * MB, 10_000 * MB, 5_000, mode).choice == mode
    assert swap_or_recompute(1024, 64 * MB, 100 * MB, 5_000, mode).choice == mode


def test_rates_must_be_positive():
    with pytest.raises(ValueError):
        swap_or_recompute(1, 1, 0.0, 1.0)


def test_the_estimate_starts_from_its_prior_and_follows_what_is_measured():
    rate = RateEstimate(1000.0)
    rate.observe(0, 1.0)  # nothing measured: ignored
    assert rate.per_s == 1000.0
    rate.observe(500, 1.0)  # the first measurement replaces the prior
    assert rate.per_s == 500.0
    rate.observe(900, 1.0)
    assert rate.per_s == pytest.approx(0.75 * 500 + 0.25 * 900)
