"""Backpressure for one request: its output not yet taken by its client is bounded.

The engine session's reader hands every delta to the request's queue at once; the request's
handler takes them out only as fast as gRPC sends them, and gRPC sends only as fast as the client
reads. A client that stops reading would make the queue grow without bound while the engine keeps
generating for nobody. ``OutputBudget`` counts what is queued (messages and wire bytes); when either
bound is passed it asks for the request to be paused in the engine (no steps; its KV blocks may be
preempted and recomputed later), and when the handler has taken half of it back, to be resumed.
A request paused with nothing taken for the stall timeout is ended by the gateway (stall_sweep.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def delta_bytes(token_ids: list, logprobs: list, prompt_logprobs: list) -> int:
    """What a delta costs on the wire, about: 4 bytes an id plus the logprob messages' own size."""
    size = 16 + 4 * len(token_ids)
    for lp in logprobs:
        size += lp.ByteSize()
    for lp in prompt_logprobs:
        size += lp.ByteSize()
    return size


class OutputBudget:
    def __init__(
        self,
        max_messages: int,
        max_bytes: int,
        set_paused: Callable[[bool], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._set_paused = set_paused
        self._clock = clock
        self.messages = 0
        self.bytes = 0
        self.paused = False
        self._quiet_since = clock()  # the later of the pause and the handler's last take

    def added(self, size: int) -> None:
        self.messages += 1
        self.bytes += size
        if not self.paused and (self.messages > self.max_messages or self.bytes > self.max_bytes):
            self.paused = True
            self._quiet_since = self._clock()
            self._set_paused(True)

    def taken(self, count: int, size: int) -> None:
        self.messages -= count
        self.bytes -= size
        self._quiet_since = self._clock()
        if self.paused and self.messages <= self.max_messages // 2 and self.bytes <= self.max_bytes // 2:
            self.paused = False
            self._set_paused(False)

    def stalled_for(self, now: float) -> float:
        """Seconds the buffer has been full with nothing taken from it (0 when not paused)."""
        return now - self._quiet_since if self.paused else 0.0
