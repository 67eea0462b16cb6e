"""The physical KV blocks: ref counts, an LRU free list, and the prefix-cache hash map.

A block with ref count 0 sits in the free list. If it still carries a hash it remains a prefix-cache
entry until allocation reaches it from the LRU end and evicts it. ``touch`` revives such a block.
A freed block without a hash is put at the allocation end: it is reused before any cache entry and
before the blocks never written.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine_svc.kv_events import KvEventLog


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash: a hit is accepted only if these match
    parent_hash: int = 0  # of the block before it in its chain (KV events, snapshots)
    salt_hash: int = 0
    listed: bool = True  # announced in KV events (a window group's pages are not: they follow group 0's)


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first key is the least recently freed block.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        # parent hash -> the listed cached blocks that continue it: a prefix that ends inside a
        # block finds there a block whose first tokens it shares (``KVCacheManager._partial``).
        self.children: dict[int, set[int]] = {}
        self.events: KvEventLog | None = None  # set while a KV-event subscriber listens
        # Called with a cached block about to be evicted (its hash still on it): the KV manager
        # spills it to the lower tiers (kv_tiers/). None: evicted blocks are simply forgotten.
        self.on_evict = None
        self.on_reset = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks with ref count 1, evicting LRU cache entries; None if too few are free."""
        if count > len(self.free):
            return None
        out = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if self.on_evict is not None and block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    self.on_evict(block)
            self._forget_hash(block)
            block.ref_count = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference; a cached free block leaves the free list."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each. A block reaching 0 that is a prefix-cache entry becomes the
        most recently freed (the last to be evicted); one that holds nothing reusable (no hash) goes
        to the head, to be allocated first: before the cache entries, and before the blocks never
        yet used, so the lazily backed CPU pool is written only as far as the cache needs
        (model_setup.allocate_kv_caches)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.block_hash is None:
                    self.free.move_to_end(block_id, last=False)

    def register(
        self,
        block_id: int,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent_hash: int = 0,
        salt_hash: int = 0,
        listed: bool = True,
    ) -> None:
        """Publish a full, computed block as a prefix-cache entry (first writer wins); ``listed``
        False: kept out of KV events (the pages of a model's other KV cache groups)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        block.parent_hash, block.salt_hash, block.listed = parent_hash, salt_hash, listed
        self.cached[block_hash] = block_id
        if listed:
            self.children.setdefault(parent_hash, set()).add(block_id)
        if self.events is not None and listed:
            self.events.stored(block_hash, parent_hash, salt_hash)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._forget_hash(block, quiet=True)
        if self.on_reset is not None:  # the host tier below goes too (kv_tiers/: the disk stays)
            self.on_reset()
        if self.events is not None:
            self.events.cleared()

    def listen(self, block_size: int) -> list:
        """Start logging KV events; returns the snapshot a new listener starts from: the cache as it
        is now, as one clear and the stores of every cached block (parents before children where
        both are cached)."""
        log = KvEventLog(block_size)
        log.cleared()
        cached = {h: self.blocks[b] for h, b in self.cached.items() if self.blocks[b].listed}
        done: set[int] = set()
        for h in cached:
            chain = []  # h and its cached ancestors not yet emitted, child first
            while h in cached and h not in done:
                done.add(h)
                chain.append(h)
                h = cached[h].parent_hash
            for c in reversed(chain):
                log.stored(c, cached[c].parent_hash, cached[c].salt_hash)
        self.events = KvEventLog(block_size)
        return log.take()

    def stop_listening(self) -> None:
        self.events = None

    def _forget_hash(self, block: Block, quiet: bool = False) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
                kids = self.children.get(block.parent_hash)
                if kids is not None:
                    kids.discard(block.block_id)
                    if not kids:
                        del self.children[block.parent_hash]
                if self.events is not None and not quiet and block.listed:
                    self.events.removed(block.block_hash)
            block.block_hash, block.token_ids = None, None

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """free + used = total; a free block has no reference; a used one is not free; refs >= 0.
        With ``expected_refs`` (block id -> holders), every ref count must equal it exactly."""
        assert len(self.free) + sum(1 for b in self.blocks if b.ref_count > 0) == self.num_blocks
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has ref count {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in self.free), f"block {b.block_id} free/ref mismatch"
            if expected_refs is not None:
                assert b.ref_count == expected_refs.get(b.block_id, 0), (
                    f"block {b.block_id}: ref {b.ref_count}, held by {expected_refs.get(b.block_id, 0)}"
                )
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h
        listed = {b for b in self.cached.values() if self.blocks[b].listed}
        indexed = {b for kids in self.children.values() for b in kids}
        assert indexed == listed, f"children index {sorted(indexed ^ listed)} out of step with the cache"
        for parent, kids in self.children.items():
            assert all(self.blocks[b].parent_hash == parent for b in kids)
