"""Block tables over the ``BlockPool``: allocation for the tokens a step will compute, prefix-cache
lookups over chained block hashes, copy-on-write for shared partial blocks, and release.

The manager owns request -> blocks: each sequence's block table and how many of its leading blocks
it has published live here, and nowhere else. It reads a sequence's tokens and counter but never
writes them (the scheduler owns ``num_computed_tokens``). What changed since the last step (table
entries, copy-on-write copies, tables released) is handed out once, by ``take_step_changes``, for
the scheduler to put into its ``SchedulerOutput``; ``pending_changes`` only looks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_svc.block_hash import chain_hash, root_hash, salt_hash
from engine_svc.block_pool import BlockPool
from engine_svc.sequence import Sequence

_NO_BLOCKS: tuple[int, ...] = ()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockUpdate:
    """A sequence's block table from entry ``first`` on, as it is now: new blocks, and replaced ones
    (copy-on-write, a prefix hit, a fork); entries before ``first`` are unchanged."""

    seq: Sequence
    first: int
    block_ids: list[int]


@dataclass
class StepChanges:
    """Everything the KV manager changed since the last step, for the runner's input batch."""

    updates: list[BlockUpdate]
    released: list[int]  # seq ids that hold no block anymore (finished, aborted or preempted)
    copies: np.ndarray  # [C, 2] int64 (src, dst) block copies to run before the forward


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[Sequence, list[int]] = {}  # only sequences that hold blocks
        self.registered: dict[Sequence, int] = {}  # leading blocks published to the prefix cache
        # (src, dst) block copies the model runner must do before the next forward (copy-on-write).
        self._copies: list[tuple[int, int]] = []
        # Sequence -> first index of its block table changed since last taken: the input batch
        # rewrites only that much of its persistent copy.
        self._changed: dict[Sequence, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    # --- reading -------------------------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        """The sequence's blocks (empty when it holds none). Read it, never change it."""
        return self.tables.get(seq, [])

    def holders(self):
        """(sequence, its block table) for every sequence that holds blocks."""
        return self.tables.items()

    def pending_changes(self) -> dict[Sequence, int]:
        """What ``take_step_changes`` would hand out (a copy: checks read, they do not consume)."""
        return dict(self._changed)

    # --- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks, each chained to its parent; the root is
        salted with the cache salt and the LoRA adapter (deterministic: ``block_hash.py`` defines
        them for routers). They are a pure function of the tokens, cached on the sequence."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        parent = hashes[-1] if hashes else self.root_of(seq)
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes[:num_blocks]

    @staticmethod
    def root_of(seq: Sequence) -> int:
        """KV computed under one adapter (or version of it), or one salt, is never served to another."""
        lora = seq.request.lora
        return root_hash(
            salt_hash(seq.request.cache_salt), None if lora is None else f"{lora.name}@{lora.version}"
        )

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq`` (never its last token: that one must be
        computed so the step has logits to sample from). Nothing is taken yet."""
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        found = []
        for i, h in enumerate(self.block_hashes(seq, max_blocks)):
            block_id = self.pool.lookup(h, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            found.append(block_id)
        return found

    # --- allocation ---------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens (after any ``cached_blocks`` prefix,
        which the scheduler then counts as computed).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        bs = self.block_size
        start = seq.num_computed_tokens
        table = self.tables.get(seq, _NO_BLOCKS)
        if not cached_blocks and start % bs and start + num_new_tokens <= len(table) * bs:
            # The common decode case: the slots exist in the last block; only a shared one needs work.
            if self.pool.blocks[table[start // bs]].ref_count == 1:
                return True
        cached_blocks = cached_blocks or []
        start += len(cached_blocks) * bs
        have = len(table) + len(cached_blocks)
        need_new = max(0, cdiv(start + num_new_tokens, bs) - have)
        # The first block written to is shared (a fork's partial prompt block): it must be copied.
        write_block = start // bs
        cow = (
            start % bs != 0
            and write_block < len(table)
            and self.pool.blocks[table[write_block]].ref_count > 1
        )
        revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        if need_new + int(cow) > self.pool.num_free - revived:
            return False
        if not need_new and not cow and not cached_blocks:
            return True
        if table is _NO_BLOCKS:
            table = self.tables[seq] = []
            self.registered[seq] = 0
        first_changed = len(table)
        if cached_blocks:
            self._take_cached(seq, table, cached_blocks)
            first_changed = 0
        if cow:
            first_changed = min(first_changed, write_block)
            (copy,) = self.pool.allocate(1)
            old = table[write_block]
            self._copies.append((old, copy))
            self.pool.release([old])
            table[write_block] = copy
        if need_new:
            table.extend(self.pool.allocate(need_new))
        if first_changed < len(table):
            self._note_change(seq, first_changed)
        return True

    def _take_cached(self, seq: Sequence, table: list[int], cached_blocks: list[int]) -> None:
        assert not table and seq.num_computed_tokens == 0
        for block_id in cached_blocks:
            self.pool.touch(block_id)
        table.extend(cached_blocks)
        self.registered[seq] = len(cached_blocks)

    def note_admission(self, seq: Sequence, num_hit_blocks: int) -> None:
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += num_hit_blocks * self.block_size

    def register_computed_blocks(self, seq: Sequence, upto: int | None = None, scheduled: int = 0) -> None:
        """Publish the full blocks of the tokens computed, plus ``scheduled`` more that this step
        computes (those wholly before token ``upto`` only, when given: a draft model's cache may lag
        one token), so that later requests can reuse them. The scheduler publishes a prompt's blocks
        as soon as it schedules them: every layer writes the step's K/V before any attention reads
        it, so a request admitted later in the same step may already share them."""
        if not self.enable_prefix_caching:
            return
        computed = seq.num_computed_tokens + scheduled
        if upto is not None:
            computed = min(upto, computed)
        full = computed // self.block_size
        done = self.registered.get(seq, 0)
        if full <= done:
            return
        bs = self.block_size
        table = self.tables[seq]
        hashes = self.block_hashes(seq, full)
        salt_h = salt_hash(seq.request.cache_salt)
        for i in range(done, full):
            parent = hashes[i - 1] if i else self.root_of(seq)
            block_tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.register(table[i], hashes[i], block_tokens, parent, salt_h)
        self.registered[seq] = full

    def trim(self, seq: Sequence, extra: int = 0) -> None:
        """Release the blocks past the next token's slot (and ``extra`` slots after it): lookahead
        slots of rejected drafts, and those that no proposal still needs."""
        keep = cdiv(len(seq.token_ids) + extra, self.block_size)
        table = self.tables.get(seq, _NO_BLOCKS)
        if len(table) > keep:
            self.pool.release(list(reversed(table[keep:])))
            del table[keep:]
            self._note_change(seq, keep)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` by reference (its counter is the scheduler's)."""
        table = self.tables.get(parent, [])
        for block_id in table:
            self.pool.touch(block_id)
        self.tables[child] = list(table)
        self.registered[child] = self.registered.get(parent, 0)
        child.block_hashes = list(parent.block_hashes)
        self._note_change(child, 0)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; the scheduler resets its counter."""
        table = self.tables.pop(seq, None)
        self.registered.pop(seq, None)
        if table is None:
            return
        # Tail blocks first, so that they are evicted before the (more shareable) head of the prefix.
        self.pool.release(list(reversed(table)))
        self._note_change(seq, 0)

    def _note_change(self, seq: Sequence, first: int) -> None:
        changed = self._changed
        if first < changed.get(seq, first + 1):
            changed[seq] = first

    # --- handing the step's changes out ---------------------------------------------------------
    def take_step_changes(self) -> StepChanges:
        """The changes since the last take, as they stand now (a sequence freed and re-admitted in
        between simply gets its new table); each is handed out once."""
        updates, released = [], []
        tables = self.tables
        for seq, first in self._changed.items():
            table = tables.get(seq)
            if table is None:
                released.append(seq.seq_id)
            else:
                updates.append(BlockUpdate(seq, first, table[first:]))
        copies = np.array(self._copies, dtype=np.int64).reshape(len(self._copies), 2)
        self._changed, self._copies = {}, []
        return StepChanges(updates, released, copies)
