"""KV-cache event subscribers of one engine: each gets the cache's snapshot, then one batch per
step that changed the cache, through a bounded queue of its own.

Everything here runs on the engine loop's thread except ``Subscriber.next`` (a gRPC thread). The
loop never waits for a subscriber: a full queue drops that subscriber (its stream ends with
RESOURCE_EXHAUSTED), and with no subscriber left the block pool stops logging events at all.
"""

from __future__ import annotations

import logging
import queue

from engine_svc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from llmserve_proto.engine.v1 import engine_pb2 as pb

log = logging.getLogger("engine_svc.server")
DEFAULT_MAX_BATCHES = 1024
MAX_BATCHES = 1 << 16
_DROPPED = object()
_CLOSED = object()


class SubscriberDropped(Exception):
    pass


class FeedClosed(Exception):
    """The engine is shutting down (or the subscription was ended)."""


class Subscriber:
    def __init__(self, max_batches: int) -> None:
        self.max_batches = max_batches
        self._queue: queue.Queue = queue.Queue(maxsize=max_batches + 1)  # +1: room for the end mark

    def next(self, timeout: float) -> pb.KvEventBatch | None:
        """The next batch; None after ``timeout`` with nothing new. Raises SubscriberDropped, or
        FeedClosed once the feed is closed."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _DROPPED:
            raise SubscriberDropped(
                f"the KV-event subscriber fell {self.max_batches} batches behind and was dropped "
                "(the engine never waits); subscribe again to start from a snapshot"
            )
        if item is _CLOSED:
            raise FeedClosed
        return item

    def offer(self, batch: pb.KvEventBatch) -> bool:
        """From the loop: False (and the subscriber is ended) when its queue is full."""
        if self._queue.qsize() >= self.max_batches:
            self._end(_DROPPED)
            return False
        self._queue.put_nowait(batch)
        return True

    def close(self) -> None:
        self._end(_CLOSED)

    def _end(self, mark) -> None:
        while True:  # what it has not read is moot: it ends here
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put_nowait(mark)


class KvEventFeed:
    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []

    def subscribe(self, engine, max_batches: int = 0) -> Subscriber:
        # What happened before this subscriber is sent to the others first: the snapshot below
        # then follows it for everyone's order to hold.
        self.publish(engine)
        sub = Subscriber(min(max_batches or DEFAULT_MAX_BATCHES, MAX_BATCHES))
        snapshot = engine.listen_kv_events()
        sub.offer(_batch(engine.num_steps, snapshot, snapshot=True))
        self.subscribers.append(sub)
        log.info("KV-event subscriber added (%d now)", len(self.subscribers))
        return sub

    def unsubscribe(self, engine, sub: Subscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)
            sub.close()
            log.info("KV-event subscriber left (%d now)", len(self.subscribers))
        if not self.subscribers:
            engine.stop_kv_events()

    def publish(self, engine) -> None:
        """After a step (or commands): the events since the last publish, to every subscriber."""
        if not self.subscribers:
            return
        events = engine.take_kv_events()
        if not events:
            return
        batch = _batch(engine.num_steps, events)
        for sub in list(self.subscribers):
            if not sub.offer(batch):
                self.subscribers.remove(sub)
                log.warning("KV-event subscriber dropped: %d batches unread", sub.max_batches)
        if not self.subscribers:
            engine.stop_kv_events()

    def close(self) -> None:
        for sub in self.subscribers:
            sub.close()
        self.subscribers.clear()


def _batch(step: int, events: list, snapshot: bool = False) -> pb.KvEventBatch:
    out = pb.KvEventBatch(step=step, snapshot=snapshot)
    for e in events:
        if type(e) is BlockStored:
            out.events.add().stored.CopyFrom(
                pb.BlockStored(
                    block_hashes=e.block_hashes,
                    parent_block_hash=e.parent_block_hash,
                    block_size=e.block_size,
                    salt_hash=e.salt_hash,
                )
            )
        elif type(e) is BlockRemoved:
            out.events.add().removed.block_hashes.extend(e.block_hashes)
        elif type(e) is AllBlocksCleared:
            out.events.add().cleared.SetInParent()
    return out
