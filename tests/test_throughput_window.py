"""The engine's tokens/s figures (Load.prompt_tokens_per_s, generation_tokens_per_s): a rate over
the last window of samples of cumulative counters, falling to 0 once nothing happens."""

from __future__ import annotations

import pytest

from engine_svc.server.throughput import ThroughputWindow


def test_rate_over_the_window_and_back_to_zero():
    w = ThroughputWindow(window_s=5.0)
    assert w.add(0.0, 0, 0) == (0.0, 0.0)
    for t in range(1, 11):  # 100 prompt and 10 generated tokens a second for 10 s
        prompt_rate, gen_rate = w.add(float(t), 100 * t, 10 * t)
    assert (prompt_rate, gen_rate) == pytest.approx((100.0, 10.0))
    # then nothing more: once the window has passed, 0
    for t in range(11, 20):
        prompt_rate, gen_rate = w.add(float(t), 1000, 100)
    assert (prompt_rate, gen_rate) == (0.0, 0.0)
