"""Block tables over the ``BlockPool``: allocation for the tokens a step will compute, prefix-cache
lookups over chained block hashes, copy-on-write for shared partial blocks, and release."""

from __future__ import annotations

from engine_svc.block_hash import chain_hash, root_hash, salt_hash
from engine_svc.block_pool import BlockPool
from engine_svc.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # (src, dst) block copies the model runner must do before the next forward (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []
        # Sequence -> first index of its block table changed since last taken: the input batch
        # rewrites only that much of its persistent copy.
        self.changed_tables: dict[Sequence, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    # --- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks, each chained to its parent; the root is
        salted with the cache salt and the LoRA adapter (deterministic: ``block_hash.py`` defines
        them for routers)."""
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
        """Make room for ``num_new_tokens`` more computed tokens (after any ``cached_blocks`` prefix).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        bs = self.block_size
        start = seq.num_computed_tokens
        if not cached_blocks and start % bs and start + num_new_tokens <= len(seq.block_table) * bs:
            # The common decode case: the slots exist in the last block; only a shared one needs work.
            if self.pool.blocks[seq.block_table[start // bs]].ref_count == 1:
                return True
        cached_blocks = cached_blocks or []
        start += len(cached_blocks) * bs
        have = len(seq.block_table) + len(cached_blocks)
        need_new = max(0, cdiv(start + num_new_tokens, bs) - have)
        # The first block written to is shared (a fork's partial prompt block): it must be copied.
        write_block = start // bs
        cow = (
            start % bs != 0
            and write_block < len(seq.block_table)
            and self.pool.blocks[seq.block_table[write_block]].ref_count > 1
        )
        revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        if need_new + int(cow) > self.pool.num_free - revived:
            return False
        first_changed = len(seq.block_table)
        if cached_blocks:
            self._take_cached(seq, cached_blocks)
            first_changed = 0
        if cow:
            first_changed = min(first_changed, write_block)
            (copy,) = self.pool.allocate(1)
            old = seq.block_table[write_block]
            self.pending_copies.append((old, copy))
            self.pool.release([old])
            seq.block_table[write_block] = copy
        if need_new:
            seq.block_table.extend(self.pool.allocate(need_new))
        if first_changed < len(seq.block_table):
            self._note_change(seq, first_changed)
        return True

    def _take_cached(self, seq: Sequence, cached_blocks: list[int]) -> None:
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in cached_blocks:
            self.pool.touch(block_id)
        seq.block_table.extend(cached_blocks)
        seq.num_computed_tokens = len(cached_blocks) * self.block_size
        seq.num_registered_blocks = len(cached_blocks)

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
        if full <= seq.num_registered_blocks:
            return
        bs = self.block_size
        hashes = self.block_hashes(seq, full)
        salt_h = salt_hash(seq.request.cache_salt)
        for i in range(seq.num_registered_blocks, full):
            parent = hashes[i - 1] if i else self.root_of(seq)
            block_tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.register(seq.block_table[i], hashes[i], block_tokens, parent, salt_h)
        seq.num_registered_blocks = full

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past the next token's slot: lookahead slots of rejected drafts."""
        keep = cdiv(len(seq.token_ids), self.block_size)
        if len(seq.block_table) > keep:
            self.pool.release(list(reversed(seq.block_table[keep:])))
            del seq.block_table[keep:]
            self._note_change(seq, keep)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` by reference."""
        for block_id in parent.block_table:
            self.pool.touch(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        self._note_change(child, 0)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so that they are evicted before the (more shareable) head of the prefix.
        self.pool.release(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        self._note_change(seq, 0)

    def _note_change(self, seq: Sequence, first: int) -> None:
        changed = self.changed_tables
        if first < changed.get(seq, first + 1):
            changed[seq] = first

    def take_changed_tables(self) -> dict[Sequence, int]:
        changed, self.changed_tables = self.changed_tables, {}
        return changed

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
