"""The waiting queue of sequences not yet running, one class per scheduling policy.

Both queues keep their ready sequences sorted by a key fixed when a sequence enters: the order the
scheduler admits them in. A paused request (its client stopped reading) is the queue's business
too: its sequences are held aside, never handed out, and go back to their own place on resume, so
the scheduler never has to skip them.

- ``FcfsQueue``: first come, first served. A preempted sequence goes back to the very front (it had
  been running: it is the oldest work), the most recently preempted first.
- ``PriorityQueue``: vLLM's rule, lower ``priority`` value first, ties by arrival (then by the
  sequence's index among the request's n). A preempted sequence goes back by the same key.
"""

from __future__ import annotations

import bisect
import itertools

from engine_svc.sequence import Request, Sequence


class RequestQueue:
    """Ready sequences in admission order, and the paused requests' sequences held aside.

    ``ready`` is the admission order itself, a list the scheduler reads (index ``j``) and takes from
    with ``take(j)``; it must not change it otherwise. ``len()`` counts held sequences too: they are
    waiting all the same."""

    def __init__(self) -> None:
        self.ready: list[Sequence] = []
        self._keys: list[tuple] = []  # parallel to ready, ascending
        self._key_of: dict[Sequence, tuple] = {}  # every sequence in the queue, held ones included
        self._held: dict[Request, list[Sequence]] = {}  # paused requests, with their queued sequences

    # --- the policy -------------------------------------------------------------------------------
    def _arrival_key(self, seq: Sequence) -> tuple:
        raise NotImplementedError

    def _requeue_key(self, seq: Sequence) -> tuple:
        raise NotImplementedError

    # --- entering and leaving ---------------------------------------------------------------------
    def push(self, seq: Sequence) -> None:
        """A new sequence, at its place by arrival."""
        self._enter(seq, self._arrival_key(seq))

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence, back at the place its policy gives it."""
        self._enter(seq, self._requeue_key(seq))

    def _enter(self, seq: Sequence, key: tuple) -> None:
        assert seq not in self._key_of, f"sequence {seq.seq_id} is queued twice"
        self._key_of[seq] = key
        held = self._held.get(seq.request)
        if held is not None:
            held.append(seq)
        else:
            self._insert(seq, key)

    def take(self, j: int) -> Sequence:
        """Hand out ``ready[j]`` (it is admitted, or ends): it leaves the queue."""
        seq = self.ready.pop(j)
        del self._keys[j]
        del self._key_of[seq]
        return seq

    def discard(self, seq: Sequence) -> None:
        """Take ``seq`` out wherever it is (ready or held); nothing if it is not queued."""
        key = self._key_of.pop(seq, None)
        if key is None:
            return
        held = self._held.get(seq.request)
        if held is not None and seq in held:
            held.remove(seq)
            return
        j = bisect.bisect_left(self._keys, key)
        assert self.ready[j] is seq
        del self.ready[j]
        del self._keys[j]

    # --- pausing ----------------------------------------------------------------------------------
    def pause(self, request: Request) -> None:
        """Hold ``request``'s queued sequences (and any that enter later) until ``resume``."""
        if request in self._held:
            return
        mine = [s for s in request.sequences if s in self._key_of]
        for seq in mine:
            j = bisect.bisect_left(self._keys, self._key_of[seq])
            del self.ready[j]
            del self._keys[j]
        self._held[request] = mine

    def resume(self, request: Request) -> None:
        """Its held sequences go back to their own places."""
        for seq in self._held.pop(request, ()):
            self._insert(seq, self._key_of[seq])

    def forget(self, request: Request) -> None:
        """The request has ended: drop its pause (its sequences have left already)."""
        self._held.pop(request, None)

    # --- reading ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._key_of)

    def __iter__(self):
        """Every queued sequence, ready ones in order first, then the held ones."""
        yield from self.ready
        for held in self._held.values():
            yield from held

    def _insert(self, seq: Sequence, key: tuple) -> None:
        j = bisect.bisect_right(self._keys, key)
        self._keys.insert(j, key)
        self.ready.insert(j, seq)


class FcfsQueue(RequestQueue):
    def __init__(self) -> None:
        super().__init__()
        self._back = itertools.count()  # arrivals: ever later
        self._front = itertools.count(-1, -1)  # preempted: ever earlier, ahead of every arrival

    def _arrival_key(self, seq: Sequence) -> tuple:
        return (next(self._back),)

    def _requeue_key(self, seq: Sequence) -> tuple:
        return (next(self._front),)


class PriorityQueue(RequestQueue):
    def _arrival_key(self, seq: Sequence) -> tuple:
        return priority_key(seq)

    _requeue_key = _arrival_key


def priority_key(seq: Sequence) -> tuple[int, int, int]:
    # Lower value = served first (vLLM's convention); ties by arrival, then by sequence index.
    return (seq.request.priority, seq.request.arrival, seq.index)


def make_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
