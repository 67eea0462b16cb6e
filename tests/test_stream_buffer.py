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


def test_stall_time_counts_from_the_oldest_untaken_output():
    """The client stopped reading when the output it left waiting arrived, not when the buffer filled."""
    clock = Clock()
    b = OutputBudget(1, 1 << 20, lambda _: None, clock)
    assert b.stalled_for(100.0) == 0.0
    b.added(1)  # waiting since 0
    clock.now = 5.0
    b.added(1)  # paused at 5
    assert b.paused and b.unread_since() == 0.0 and b.stalled_for(9.0) == 9.0
    clock.now = 10.0
    b.taken(0, 0)  # a take of nothing still shows the client reads
    assert b.stalled_for(12.0) == 2.0


def test_output_waiting_untaken_for_pause_after_pauses_before_the_bounds():
    calls, clock = [], Clock()
    b = OutputBudget(64, 1 << 20, calls.append, clock, pause_after_s=1.0)
    b.added(10)
    clock.now = 0.9
    b.added(10)
    assert calls == []  # younger than the limit
    b.taken(2, 20)  # read: nothing waits
    clock.now = 5.0
    b.added(10)  # a slow step (4 s since the take) is not an unread client: this just arrived
    assert calls == []
    clock.now = 6.0
    b.added(10)
    assert calls == [True] and b.unread_since() == 5.0
    seen = []
    b.on_pause = seen.append
    b.taken(2, 20)
    assert calls == [True, False] and seen == [False] and b.unread_since() is None


def test_a_send_the_client_never_made_room_for_starts_the_clock():
    """With slow engine steps, the first delta after a blocked send already shows an unread client."""
    calls, clock = [], Clock()
    b = OutputBudget(64, 1 << 20, calls.append, clock, pause_after_s=1.0)
    b.added(10)
    b.taken(1, 10)
    b.send_started()  # at 0: the handler's send waits for the client's window
    clock.now = 5.0
    b.added(10)  # the next step's output, 5 s later: the client has read nothing for 5 s
    assert calls == [True] and b.unread_since() == 0.0 and b.stalled_for(7.0) == 7.0
    b.send_done()
    b.taken(1, 10)
    assert calls == [True, False]
    b.send_started()
    b.send_done()  # a reading client: its sends complete
    clock.now = 9.0
    b.added(10)
    assert calls == [True, False]


def test_pauses_past_the_token_bound_when_messages_carry_several_tokens():
    calls = []
    b = OutputBudget(1000, 1 << 20, calls.append, max_tokens=8)
    b.added(10, tokens=5)  # a step that accepted drafts: five tokens in one message
    assert calls == []
    b.added(10, tokens=5)
    assert calls == [True]
    b.taken(1, 10, tokens=5)  # 5 left: more than half of 8
    assert calls == [True]
    b.taken(1, 10, tokens=5)
    assert calls == [True, False]
