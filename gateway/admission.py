"""Admission control: at most N requests in the engine, at most Q waiting; beyond that, refuse now.

A refused request costs nothing (no tokenizing, no engine work) and the client learns at once
that it should back off, instead of waiting in an unbounded queue.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

import grpc

from gateway.errors import RequestError


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self):
        await self._enter()
        try:
            yield
        finally:
            self._leave()

    async def _enter(self) -> None:
        if self.running < self.max_concurrent and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at its limit ({self.max_concurrent} running, {self.max_queue} "
                f"queued); retry later",
                retry_after_s=1.0,
            )
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # _leave hands its slot over: running stays the same
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._leave()  # the slot was handed to us just as we were cancelled: pass it on
            elif fut in self._waiters:  # a _leave between the cancel and now has popped it already
                self._waiters.remove(fut)
            raise

    def _leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
