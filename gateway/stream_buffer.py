"""Backpressure for one request: its output not yet taken by its client is bounded.

The engine session's reader hands every delta to the request's queue at once; the request's
handler takes them out only as fast as gRPC sends them, and gRPC sends only as fast as the client
reads. A client that stops reading would make the queue grow without bound while the engine keeps
generating for nobody. ``OutputBudget`` counts what is queued (messages, tokens and wire bytes: a
message may carry several tokens, drafts accepted in one step) and how long
the oldest of it has waited. It asks for the request to be paused in the engine (no steps; its KV
blocks are the first preempted, and its seat and admission slot go to others) when either bound is
passed, or when output has waited untaken (or a send has not completed) for ``pause_after_s``: a
client that stops reading is seen at the first engine step a second after its flow-control window
filled, instead of after 64 more engine steps. When
the handler has taken half of it back, the request is resumed.

The stall clock starts when the client stopped reading: the send it never made room for, or the
oldest output not taken, whichever came first; not when the buffer filled. A paused request whose client takes
nothing for the stall timeout is ended by the gateway (stall_sweep.py).
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
        pause_after_s: float = 0.0,  # 0: only the bounds pause
        max_tokens: int = 1 << 30,
    ) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens
        self.pause_after_s = pause_after_s
        self._set_paused = set_paused
        self._clock = clock
        self.messages = 0
        self.bytes = 0
        self.tokens = 0
        self.paused = False
        # The gateway's admission is told too (a paused stream gives its slot back); set after submit.
        self.on_pause: Callable[[bool], None] | None = None
        self.waiting_since: float | None = None  # when the oldest untaken output arrived; None: none
        self.sending_since: float | None = None  # when the handler's pending send began; None: none

    def added(self, size: int, tokens: int = 1) -> None:
        now = self._clock()
        if self.messages == 0:
            self.waiting_since = now
        self.messages += 1
        self.bytes += size
        self.tokens += tokens
        if self.paused:
            return
        unread = self.pause_after_s > 0 and now - self._unread_start() >= self.pause_after_s
        if (
            unread
            or self.messages > self.max_messages
            or self.bytes > self.max_bytes
            or self.tokens > self.max_tokens
        ):
            self._change(True)

    def send_started(self) -> None:
        """The handler gave gRPC a message; until ``send_done`` the client has not made room for it."""
        self.sending_since = self._clock()

    def send_done(self) -> None:
        self.sending_since = None

    def _unread_start(self) -> float:
        # The client stopped reading when a send did not complete, or, while the handler was busy
        # elsewhere, when the oldest output it has not taken arrived.
        if self.sending_since is None or self.waiting_since is None:
            return self.waiting_since if self.sending_since is None else self.sending_since
        return min(self.sending_since, self.waiting_since)

    def taken(self, count: int, size: int, tokens: int | None = None) -> None:
        self.messages -= count
        self.bytes -= size
        self.tokens -= count if tokens is None else tokens
        # Whatever is left is newer than what the client just took: it is reading.
        self.waiting_since = self._clock() if self.messages > 0 else None
        if (
            self.paused
            and self.messages <= self.max_messages // 2
            and self.bytes <= self.max_bytes // 2
            and self.tokens <= self.max_tokens // 2
        ):
            self._change(False)

    def _change(self, paused: bool) -> None:
        self.paused = paused
        self._set_paused(paused)
        if self.on_pause is not None:
            self.on_pause(paused)

    def unread_since(self) -> float | None:
        """When the client stopped reading, if it is paused for that (None: it is not)."""
        return self._unread_start() if self.paused else None

    def stalled_for(self, now: float) -> float:
        """Seconds since the client stopped reading, while paused (0 when not paused)."""
        since = self.unread_since()
        return 0.0 if since is None else now - since
