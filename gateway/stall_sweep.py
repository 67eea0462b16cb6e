"""End the streams whose client stopped reading (``--stream-stall-timeout``).

A request whose output budget is full is paused in the engine (stream_buffer.py); if its client
then takes nothing for the stall timeout, it is ended here: the client gets RESOURCE_EXHAUSTED
naming the timeout (after whatever gRPC had already buffered for it), and the handler is cancelled
so that its ``finally`` aborts the request in the engine and gives its admission slot back. The
handler is stuck in gRPC's send at that point, so it cannot end itself; the status is sent from
here first, since a handler cancelled without one would leave the call open until the client's
own deadline.
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

    async def end_stalled(self, timeout_s: float) -> None:
        self.stalled = True
        with request_scope(self.log_id):
            log.warning("client stopped reading for %.1fs: aborting the request", timeout_s)
        message = (
            f"the client read nothing of this stream for {timeout_s:g}s while its output buffer "
            f"was full (stream_stall_timeout_s); the request was aborted"
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
    def __init__(self, streams: dict[str, StreamControl], timeout_s: float) -> None:
        self.streams = streams
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None
        self._ending: set[asyncio.Task] = set()

    def start(self) -> None:
        if self.timeout_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stall-sweep")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def sweep(self, now: float) -> int:
        """End every stream stalled past the timeout; returns how many."""
        n = 0
        for c in list(self.streams.values()):
            if c.stalled or c.handle is None or c.handle.stalled_for(now) <= self.timeout_s:
                continue
            n += 1
            task = asyncio.get_running_loop().create_task(c.end_stalled(self.timeout_s))
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
        return n

    async def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep(time.monotonic())
