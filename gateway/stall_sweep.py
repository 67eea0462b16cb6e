"""End the streams whose client stopped reading (``--stream-stall-timeout``, ``--max-paused-streams``).

A stream whose client stops reading is paused in the engine (stream_buffer.py) and gives its
admission slot back (admission.py). Two rules end it here:
- its client takes nothing for the stall timeout, counted from when it stopped reading: ended with
  RESOURCE_EXHAUSTED naming ``stream_stall_timeout_s``;
- more streams are paused than ``max_paused_streams``: the ones unread longest are ended first
  (shed), with RESOURCE_EXHAUSTED naming that limit, so that a burst of never-read streams holds
  a bounded amount of gateway memory and engine state.

The client gets the status after whatever gRPC had already buffered for it, and the handler is
cancelled so that its ``finally`` aborts the request in the engine. The handler is stuck in gRPC's
send at that point, so it cannot end itself; the status is sent from here first, since a handler
cancelled without one would leave the call open until the client's own deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from engine_svc.rpc.log_setup import request_scope

log = logging.getLogger("gateway.requests")


@dataclass
class StreamControl:
    """One GenerateStream call: the task that runs its handler, its context, and its handle."""

    task: asyncio.Task
    context: object  # grpc.aio.ServicerContext
    log_id: str
    handle: object | None = None  # the RequestHandle once submitted
    stalled: bool = False
    outcome: str = "stalled"  # how the sweep ended it: "stalled" (the timeout) or "shed"
    metrics: object | None = None  # its RequestMetrics: the tokens gRPC took, for the log line

    async def end_stalled(self, message: str, outcome: str, unread_s: float) -> None:
        self.stalled = True
        self.outcome = outcome
        m = self.metrics
        fields = {"outcome": outcome}
        if m is not None:
            fields.update(completion_tokens=m.sent_tokens, unconfirmed_tokens=m.unconfirmed_tokens)
        with request_scope(self.log_id):
            log.warning(
                "client read nothing for %.1fs: %s, the request is aborted",
                unread_s,
                "stall timeout" if outcome == "stalled" else "shed (too many paused streams)",
                extra={"fields": fields},
            )
        status = asyncio.ensure_future(self._send_status(message))
        await asyncio.sleep(0)  # the status batch starts on the abort's first step
        self.task.cancel()
        await status

    async def _send_status(self, message: str) -> None:
        try:
            await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        except BaseException:  # noqa: BLE001 - abort() always raises; the status is on its way
            pass


class StallSweeper:
    def __init__(self, streams: dict[str, StreamControl], timeout_s: float, max_paused: int = 0) -> None:
        self.streams = streams
        self.timeout_s = timeout_s
        self.max_paused = max_paused
        self.num_stalled = self.num_shed = 0
        self._task: asyncio.Task | None = None
        self._ending: set[asyncio.Task] = set()

    def start(self) -> None:
        if self.timeout_s > 0 or self.max_paused > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stall-sweep")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def sweep(self, now: float) -> int:
        """End every stream stalled past the timeout, then the longest unread of those paused past
        ``max_paused``; returns how many."""
        paused: list[tuple[float, StreamControl]] = []
        n = 0
        for c in list(self.streams.values()):
            since = None if c.stalled or c.handle is None else c.handle.unread_since()
            if since is None:
                continue
            if self.timeout_s > 0 and now - since > self.timeout_s:
                message = (
                    f"the client read nothing of this stream for {now - since:.1f}s "
                    f"(stream_stall_timeout_s={self.timeout_s:g}); the request was aborted"
                )
                self._end(c, message, "stalled", now - since)
                self.num_stalled += 1
                n += 1
            else:
                paused.append((since, c))
        excess = len(paused) - self.max_paused if self.max_paused > 0 else 0
        if excess > 0:
            paused.sort(key=lambda item: item[0])
            for since, c in paused[:excess]:
                message = (
                    f"the client read nothing of this stream for {now - since:.1f}s while "
                    f"{len(paused)} streams were paused (max_paused_streams={self.max_paused}); "
                    f"the one unread longest is ended first; the request was aborted"
                )
                self._end(c, message, "shed", now - since)
            self.num_shed += excess
            n += excess
        return n

    def _end(self, c: StreamControl, message: str, outcome: str, unread_s: float) -> None:
        c.stalled = True  # at once: the next sweep must not end it again
        task = asyncio.get_running_loop().create_task(c.end_stalled(message, outcome, unread_s))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4) if self.timeout_s > 0 else 1.0
        while True:
            await asyncio.sleep(period)
            self.sweep(time.monotonic())
