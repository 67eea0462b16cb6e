"""KV-cache events at the engine: a router's replay of the feed equals the pool's own set of cached
block hashes after every step of a workload with evictions; the hashes follow the documented
definition (checked against an independent implementation here, and across processes with
different hash seeds); a slow subscriber is dropped; nobody listening costs nothing."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys

import pytest

from engine_svc import SamplingParams
from engine_svc.block_hash import prompt_block_hashes
from engine_svc.server.kv_event_feed import KvEventFeed, SubscriberDropped
from llmserve_proto.engine.v1 import engine_pb2 as pb
from tests.engine_helpers import make_engine


class ReplayRouter:
    """What an external router keeps: the set of cached block hashes, from the events alone."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.parents: dict[int, int] = {}
        self.batches = 0

    def apply(self, batch: pb.KvEventBatch) -> None:
        self.batches += 1
        for e in batch.events:
            kind = e.WhichOneof("kind")
            if kind == "cleared":
                self.cached.clear()
            elif kind == "stored":
                parent = e.stored.parent_block_hash
                for h in e.stored.block_hashes:
                    self.cached.add(h)
                    self.parents[h] = parent
                    parent = h
            else:
                self.cached.difference_update(e.removed.block_hashes)

    def drain(self, sub) -> None:
        while (batch := sub.next(timeout=0)) is not None:
            self.apply(batch)


def _b2(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def reference_hashes(ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """The definition in docs/scaling-out.md, written out independently of engine_svc.block_hash."""
    salt_h = _b2(salt.encode()) if salt else 0
    parent = _b2(b"llmserve-prefix-root" + struct.pack("<Q", salt_h))
    out = []
    for i in range(len(ids) // block_size):
        block = ids[i * block_size : (i + 1) * block_size]
        parent = _b2(struct.pack("<Q", parent) + struct.pack(f"<{len(block)}i", *block))
        out.append(parent)
    return out


def test_hash_definition_matches_the_documented_one():
    rng = random.Random(3)
    ids = [rng.randrange(0, 200_000) for _ in range(70)]
    for salt in (None, "tenant-a", "ünïcode"):
        assert prompt_block_hashes(ids, 16, salt) == reference_hashes(ids, 16, salt)
    assert prompt_block_hashes(ids, 16, "a") != prompt_block_hashes(ids, 16, "b")


def test_hashes_are_the_same_in_every_process():
    code = (
        "from engine_svc.block_hash import prompt_block_hashes;"
        "print(prompt_block_hashes(list(range(100, 164)), 16, 'acme'))"
    )
    outs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))
    assert len(outs) == 1
    assert outs.pop().strip() == str(reference_hashes(list(range(100, 164)), 16, "acme"))


def _workload(vocab: int, seed: int = 0):
    """Shared system prompts (prefix hits), distinct tails, two tenants: more blocks than the pool."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(3)]
    out = []
    for i in range(40):
        prompt = systems[i % 3] + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))]
        out.append((f"r{i}", prompt, "tenant-a" if i % 4 else "tenant-b"))
    return out


@pytest.mark.parametrize("subscribe_after_steps", [0, 25])
def test_replayed_events_equal_the_pools_cached_set(tiny_llama, subscribe_after_steps):
    engine = make_engine(tiny_llama, num_kv_blocks=24, max_num_batched_tokens=64)
    assert engine.kv.pool.events is None  # nobody listens: no log at all
    feed, router, sub = KvEventFeed(), ReplayRouter(), None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    pending = _workload(1024)
    steps = removed = 0
    finished: list[str] = []  # request ids in the order they finished
    prompts = {rid: (prompt, salt) for rid, prompt, salt in pending}
    while pending or engine.has_unfinished_requests():
        for rid, prompt, salt in pending[:3]:
            engine.add_request(rid, prompt, params, cache_salt=salt)
        pending = pending[3:]
        if steps == subscribe_after_steps:  # a late subscriber starts from the snapshot
            sub = feed.subscribe(engine)
        finished += [d.request_id for d in engine.step() if d.finish_reason is not None]
        steps += 1
        feed.publish(engine)
        if sub is not None:
            before = len(router.cached)
            router.drain(sub)
            removed += max(0, before - len(router.cached))
            assert router.cached == engine.cached_block_hashes(), f"after step {steps}"
    assert removed > 0 or subscribe_after_steps, "the workload must evict"
    # A router computes a cached prompt's hashes from its token ids and finds them (the request
    # that finished last: its blocks are the freshest in the cache, whatever order the scheduler
    # ran the others in).
    prompt, salt = prompts[finished[-1]]
    want = prompt_block_hashes(prompt, 16, salt)
    found = [h in router.cached for h in want]
    assert found[0] and found == sorted(found, reverse=True)  # a cached prefix of the chain
    assert router.parents[want[1]] == want[0]
    other_tenant = prompt_block_hashes(prompt, 16, "tenant-b" if salt == "tenant-a" else "tenant-a")
    assert not set(other_tenant) & set(want)


def test_reset_prefix_cache_is_one_clear(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=32)
    feed, router = KvEventFeed(), ReplayRouter()
    sub = feed.subscribe(engine)
    engine.add_request("a", list(range(3, 50)), SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    feed.publish(engine)
    router.drain(sub)
    assert router.cached and router.cached == engine.cached_block_hashes()
    engine.kv.pool.reset_prefix_cache()
    feed.publish(engine)
    batch = sub.next(timeout=0)
    assert [e.WhichOneof("kind") for e in batch.events] == ["cleared"]
    router.apply(batch)
    assert router.cached == engine.cached_block_hashes() == set()


def test_slow_subscriber_is_dropped_and_events_stop(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=64)
    feed = KvEventFeed()
    slow = feed.subscribe(engine, max_batches=3)
    for i in range(6):  # each request stores new blocks: one batch per publish
        engine.add_request(f"r{i}", [i + 3] * 40, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        feed.publish(engine)
    with pytest.raises(SubscriberDropped, match="fell 3 batches behind"):
        slow.next(timeout=0)
    assert feed.subscribers == [] and engine.kv.pool.events is None  # off again


def test_the_public_event_messages_read_the_engines_bytes():
    """The gateway relays engine.v1 batches as llmserve.v1 ones by their bytes: the layouts agree."""
    from llmserve_proto.llmserve.v1 import router_pb2

    batch = pb.KvEventBatch(step=7, snapshot=True)
    batch.events.add().cleared.SetInParent()
    batch.events.add().stored.CopyFrom(
        pb.BlockStored(block_hashes=[2**64 - 1, 5], parent_block_hash=3, block_size=16, salt_hash=9)
    )
    batch.events.add().removed.block_hashes.extend([5, 6])
    public = router_pb2.KvEventBatch.FromString(batch.SerializeToString())
    assert public.step == 7 and public.snapshot and public.replica == 0
    assert [e.WhichOneof("kind") for e in public.events] == ["cleared", "stored", "removed"]
    s = public.events[1].stored
    assert (list(s.block_hashes), s.parent_block_hash, s.block_size, s.salt_hash) == (
        [2**64 - 1, 5],
        3,
        16,
        9,
    )
    assert list(public.events[2].removed.block_hashes) == [5, 6]


class _Aborted(Exception):
    pass


class _Context:
    """What EngineServicer.StreamKvEvents uses of a gRPC context."""

    def __init__(self) -> None:
        self.code = self.details = None
        self.callbacks = []

    def is_active(self) -> bool:
        return True

    def add_callback(self, fn) -> None:
        self.callbacks.append(fn)

    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted


def test_a_subscriber_that_does_not_read_is_dropped_and_the_engine_goes_on(tiny_llama):
    """engine.v1 StreamKvEvents: a subscriber that reads nothing after its snapshot is ended with
    RESOURCE_EXHAUSTED once its buffer is full, while the loop keeps stepping; events stop."""
    import grpc

    from engine_svc.server.engine_loop import EngineLoop
    from engine_svc.server.servicer import EngineServicer

    engine = make_engine(tiny_llama, num_kv_blocks=64)
    loop = EngineLoop(engine, heartbeat_s=0.05)
    loop.start()
    try:
        servicer, ctx = EngineServicer(loop, pb.EngineInfo()), _Context()
        stream = servicer.StreamKvEvents(pb.KvEventsRequest(max_buffered_batches=2), ctx)
        assert next(stream).snapshot
        session = loop.call(lambda: loop.open_session("test", 0, 0))
        params = SamplingParams(temperature=0.0, max_tokens=2)
        for i in range(8):  # each stores new blocks in steps of its own: more than 2 batches
            loop.call(lambda i=i: loop.add_request(session, f"r{i}", [i + 3] * 40, params, 0, None))
            deadline = 50
            while loop.call(engine.has_unfinished_requests) and deadline:
                deadline -= 1
                loop.call(lambda: None)
        assert not loop.call(engine.has_unfinished_requests)  # the engine never waited for the reader
        with pytest.raises(_Aborted):
            next(stream)
        assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "fell 2 batches behind" in ctx.details
        assert loop.call(lambda: engine.kv.pool.events is None and not loop.kv_events.subscribers)
    finally:
        loop.stop()
