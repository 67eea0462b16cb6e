"""Admission control: at most N requests in the engine, at most Q waiting; beyond that, refuse now.

A refused request costs nothing (no tokenizing, no engine work) and the client learns at once
that it should back off, instead of waiting in an unbounded queue.

Two rules keep one client's burst (say, hundreds of streams it never reads) from taking the service:
- a request paused because its client does not read gives its slot back while paused (the stall
  sweep bounds how many may be paused: ``max_paused_streams``), and takes one again when it
  resumes, even past the limit;
- the last ``new_client_slots`` slots go only to a client (one connection: a gRPC channel, an HTTP
  connection) that holds no slot yet, so a new client gets in at once whatever others have queued.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Hashable

import grpc

from gateway.errors import RequestError


class Slot:
    """One request's admission; ``set_paused`` gives the slot back while its stream is paused."""

    def __init__(self, admission: Admission, client: Hashable | None) -> None:
        self._admission = admission
        self.client = client
        self.held = False

    def set_paused(self, paused: bool) -> None:
        if paused and self.held:
            self.held = False
            self._admission._release(self.client)
        elif not paused and not self.held:
            self.held = True
            self._admission._take(self.client)  # it is in the engine already: never queued


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, new_client_slots: int = 0) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.new_client_slots = min(new_client_slots, max_concurrent)
        self.running = 0  # slots held (paused requests hold none)
        self._held: collections.Counter = collections.Counter()  # client -> slots it holds
        self._waiters: collections.deque[tuple[asyncio.Future, Hashable | None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def held_by(self, client: Hashable | None) -> int:
        return self._held[client] if client is not None else 0

    @contextlib.asynccontextmanager
    async def slot(self, client: Hashable | None = None):
        """``client`` names the caller's connection (None: a caller of its own, always new)."""
        slot = Slot(self, client)
        await self._enter(client)
        slot.held = True
        try:
            yield slot
        finally:
            if slot.held:
                slot.held = False
                self._release(client)

    def _may_take(self, client: Hashable | None) -> bool:
        if self.running < self.max_concurrent - self.new_client_slots:
            return True
        return self.running < self.max_concurrent and self.held_by(client) == 0

    async def _enter(self, client: Hashable | None) -> None:
        # No waiter may take a free slot (each release hands it on at once), so one that this
        # request may take is not owed to anyone queued ahead of it.
        if self._may_take(client):
            self._take(client)
            return
        if len(self._waiters) >= self.max_queue:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at its limit: {self.running} requests running "
                f"(max_concurrent_requests={self.max_concurrent}, of which new_client_slots="
                f"{self.new_client_slots} are kept for clients holding none; this client holds "
                f"{self.held_by(client)}) and {len(self._waiters)} queued "
                f"(max_queue_length={self.max_queue}); retry later",
                retry_after_s=1.0,
            )
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, client)
        self._waiters.append(entry)
        try:
            await fut  # _dispatch took the slot for us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(client)  # the slot was handed to us just as we were cancelled: pass it on
            elif entry in self._waiters:  # a dispatch between the cancel and now has popped it already
                self._waiters.remove(entry)
            raise

    def _take(self, client: Hashable | None) -> None:
        self.running += 1
        if client is not None:
            self._held[client] += 1

    def _release(self, client: Hashable | None) -> None:
        self.running -= 1
        if client is not None:
            self._held[client] -= 1
            if not self._held[client]:
                del self._held[client]
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to the first waiters that may take them (FIFO among those)."""
        while self._waiters and self.running < self.max_concurrent:
            for entry in self._waiters:
                fut, client = entry
                if fut.done():
                    continue  # cancelled: its handler removes it
                if self._may_take(client):
                    break
            else:
                return
            self._waiters.remove(entry)
            self._take(client)
            fut.set_result(None)
