"""Tokens per second over the last few seconds, from the engine's cumulative counters (sampled each
time the loop refreshes its load figures)."""

from __future__ import annotations

from collections import deque


class ThroughputWindow:
    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated)

    def add(self, now: float, prompt_tokens: int, generation_tokens: int) -> tuple[float, float]:
        """Record a sample; returns (prompt tokens/s, generation tokens/s) over the window."""
        s = self._samples
        s.append((now, prompt_tokens, generation_tokens))
        while len(s) > 2 and now - s[1][0] >= self.window_s:  # keep one sample at or past the edge
            s.popleft()
        t0, p0, g0 = s[0]
        dt = now - t0
        if dt <= 0:
            return 0.0, 0.0
        return (prompt_tokens - p0) / dt, (generation_tokens - g0) / dt
