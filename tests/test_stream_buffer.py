"""OutputBudget alone: pause past either bound, resume once half is taken, stall time while full."""

from __future__ import annotations

from gateway.stream_buffer import OutputBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pauses_past_the_message_bound_and_resumes_at_half():
    calls, clock = [], Clock()
    b = OutputBudget(4, 1 << 20, calls.append, clock)
    for _ in range(4):
        b.added(10)
    assert calls == [] and not b.paused
    b.added(10)
    assert calls == [True] and b.paused
    b.added(10)  # more arrives from steps already running: no second pause
    assert calls == [True]
    b.taken(3, 30)  # 3 left: more than half of 4
    assert calls == [True]
    b.taken(1, 10)
    assert calls == [True, False] and not b.paused


def test_pauses_past_the_byte_bound():
    calls = []
    b = OutputBudget(1000, 100, calls.append)
    b.added(60)
    b.added(60)
    assert calls == [True]


def test_stall_time_counts_from_the_pause_or_the_last_take():
    clock = Clock()
    b = OutputBudget(1, 1 << 20, lambda _: None, clock)
    assert b.stalled_for(100.0) == 0.0
    b.added(1)
    clock.now = 5.0
    b.added(1)  # paused at 5
    assert b.stalled_for(9.0) == 4.0
    clock.now = 10.0
    b.taken(0, 0)  # a take of nothing still shows the client reads
    assert b.stalled_for(12.0) == 2.0
