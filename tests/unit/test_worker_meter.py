"""The prefill meter the router weighs prefill queues with: tokens per second of busy time."""

import pytest

from llmesh.engine.worker import PrefillMeter


def test_rate_counts_only_busy_time_and_overlapping_requests_once():
    now = [0.0]
    meter = PrefillMeter(clock=lambda: now[0])
    meter.started()
    now[0] = 0.5
    meter.finished(500)  # 0.5 s busy: below the window, no rate yet
    assert meter.tokens_per_s == 0
    now[0] = 10.0  # idle for 9.5 s: not counted
    meter.started()
    meter.started()  # two prompts at once
    now[0] = 10.4
    meter.finished(200)
    now[0] = 10.8
    meter.finished(600)  # 1.3 s busy in all, 1300 tokens
    assert meter.tokens_per_s == pytest.approx(1000)
    meter.started()
    now[0] = 12.8
    meter.finished(1000)  # 500 tokens/s over the next window, smoothed
    assert meter.tokens_per_s == pytest.approx(0.3 * 500 + 0.7 * 1000)
