"""A single-producer ring of int32 token ids in one shared-memory segment.

Layout (little-endian, fixed; no pickle):

    offset  0  u32 magic "LSRN"   u32 version
    offset  8  u64 capacity        (int32 slots)
    offset 16  u64 written         (slots written so far; producer-owned)
    offset 24  u64 released        (slots the consumer is done with; consumer-owned)
    offset 64  int32[capacity]     data

Positions are counters that only grow; slot = counter % capacity. The producer writes a run of
ids, then names it to the consumer as (start, length) in a gRPC message, so the message itself
orders the write before the read. The consumer copies the run out and releases it; runs may be
released out of order (the engine serves Submit calls on several threads), so the released
counter advances only over a contiguous prefix. When a run does not fit, ``try_write`` says so and
the caller sends those ids inline instead: a slow reader never blocks a writer.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence

import numpy as np

from engine_svc.rpc.shm_segments import attach_segment, create_segment

MAGIC = 0x4E52534C  # "LSRN" little-endian
VERSION = 1
HEADER_BYTES = 64
_MAGIC, _CAPACITY, _WRITTEN, _RELEASED = 0, 1, 2, 3  # u64 header words (magic word holds version too)


class TokenRing:
    """One ring; the process that made it is the one that unlinks it."""

    def __init__(self, segment, owner: bool) -> None:
        self._seg = segment
        self._owner = owner
        self.name = segment.name.lstrip("/")
        self._header = np.ndarray((HEADER_BYTES // 8,), dtype=np.uint64, buffer=segment.buf, offset=0)
        capacity = (segment.size - HEADER_BYTES) // 4
        if owner:
            self._header[:] = 0
            self._header[_MAGIC] = MAGIC | (VERSION << 32)
            self._header[_CAPACITY] = capacity
        elif int(self._header[_MAGIC]) != MAGIC | (VERSION << 32) or int(self._header[_CAPACITY]) > capacity:
            raise ValueError(f"shared-memory segment {segment.name} is not a version-{VERSION} token ring")
        self.capacity = int(self._header[_CAPACITY])
        self._data = np.ndarray((self.capacity,), dtype=np.int32, buffer=segment.buf, offset=HEADER_BYTES)
        self._lock = threading.Lock()
        self._done: list[tuple[int, int]] = []  # consumer: released runs not yet contiguous

    @classmethod
    def create(cls, num_bytes: int) -> TokenRing:
        if num_bytes < HEADER_BYTES + 4:
            raise ValueError(f"a ring needs at least {HEADER_BYTES + 4} bytes")
        return cls(create_segment(num_bytes), owner=True)

    @classmethod
    def attach(cls, name: str) -> TokenRing:
        return cls(attach_segment(name), owner=False)

    @property
    def written(self) -> int:
        return int(self._header[_WRITTEN])

    @property
    def released(self) -> int:
        return int(self._header[_RELEASED])

    # Producer side -------------------------------------------------------------------------

    def try_write(self, ids: Sequence[int] | np.ndarray) -> int | None:
        """Copy ``ids`` in and return the run's start, or None when there is no room."""
        n = len(ids)
        written = int(self._header[_WRITTEN])
        if n > self.capacity - (written - int(self._header[_RELEASED])):
            return None
        pos = written % self.capacity
        first = min(n, self.capacity - pos)
        arr = np.asarray(ids, dtype=np.int32)
        self._data[pos : pos + first] = arr[:first]
        if first < n:
            self._data[: n - first] = arr[first:]
        self._header[_WRITTEN] = written + n
        return written

    # Consumer side -------------------------------------------------------------------------

    def read(self, start: int, length: int) -> list[int]:
        """Copy a run out; raises ValueError for a run that was not written or is already released."""
        if length == 0:
            return []
        if start < int(self._header[_RELEASED]) or start + length > int(self._header[_WRITTEN]) or length < 0:
            raise ValueError(f"ring span [{start}, {start + length}) is outside the live region")
        pos = start % self.capacity
        first = min(length, self.capacity - pos)
        out = self._data[pos : pos + first].tolist()
        if first < length:
            out += self._data[: length - first].tolist()
        return out

    def release(self, start: int, length: int) -> None:
        """Give a consumed run back; the producer can reuse it once every earlier run is back too."""
        if length == 0:
            return
        with self._lock:
            heapq.heappush(self._done, (start, start + length))
            released = int(self._header[_RELEASED])
            while self._done and self._done[0][0] <= released:
                released = max(released, heapq.heappop(self._done)[1])
            self._header[_RELEASED] = released

    def read_and_release(self, start: int, length: int) -> list[int]:
        ids = self.read(start, length)
        self.release(start, length)
        return ids

    # Lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Detach (and unlink, when this process made it). Safe to call twice."""
        if self._seg is None:
            return
        del self._header, self._data  # numpy views pin the buffer; close() fails while they live
        seg, self._seg = self._seg, None
        seg.close()
        if self._owner:
            try:
                seg.unlink()
            except FileNotFoundError:
                pass
