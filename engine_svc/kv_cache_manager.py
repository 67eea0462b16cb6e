"""Block tables over the ``BlockPool``: allocation for the tokens a step will compute, prefix-cache
lookups over chained block hashes, copy-on-write for shared partial blocks, and release.

The manager owns request -> blocks: each sequence's block table and how many of its leading blocks
it has published live here, and nowhere else. A model with sliding-window layers has more than one
KV cache group (``kv_groups.py``): one table per group, all drawing pages from one pool; a window
group releases the blocks its window has passed (``NULL_BLOCK`` in their entries). It reads a
sequence's tokens and counter but never writes them (the scheduler owns ``num_computed_tokens``).
What changed since the last step (table entries, copy-on-write copies, tables released) is handed
out once, by ``take_step_changes``, for the scheduler to put into its ``SchedulerOutput``;
``pending_changes`` only looks.

With lower tiers (``kv_tiers/``), a cached block the pool evicts is spilled (a save the runner
does before the step's forward, its bytes then kept by the ``TieredStore``), and a lookup that
misses the pool but finds the block below loads it into a fresh pool block (a load the runner does
before the forward), published there as any cached block: from then on it is a pool hit. The
moves travel with the step's changes, in the order they were decided, copy-on-write copies among
them (a page a queued copy reads or writes may be released and loaded into in the same schedule)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_svc.block_hash import chain_hash, root_hash, salt_hash
from engine_svc.block_pool import BlockPool
from engine_svc.kv_groups import NULL_BLOCK
from engine_svc.kv_tiers.entry import BlockMeta
from engine_svc.kv_tiers.store import TieredStore
from engine_svc.kv_tiers.transfer import TierOp
from engine_svc.sequence import Sequence

_NO_BLOCKS: tuple[int, ...] = ()
_NO_COPIES = np.zeros((0, 2), dtype=np.int64)  # most steps copy nothing: one shared, read-only [0, 2]
_NO_COPIES.flags.writeable = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockUpdate:
    """A sequence's block table (of KV cache group ``group``) from entry ``first`` on, as it is
    now: new blocks, and replaced ones (copy-on-write, a prefix hit, a fork, a window passing);
    entries before ``first`` are unchanged."""

    seq_id: int
    first: int
    block_ids: list[int]
    group: int = 0


@dataclass
class StepChanges:
    """Everything the KV manager changed since the last step, for the runner's input batch."""

    updates: list[BlockUpdate]
    released: list[int]  # seq ids that hold no block anymore (finished, aborted or preempted)
    copies: np.ndarray  # [C, 2] int64 (src, dst) block copies to run before the forward
    tier_ops: list[TierOp] | None = None  # saves to and loads from the lower tiers, in order, first
    # (parent, child) seq ids: the child took the parent's table (and what its blocks hold)
    forks: list[tuple[int, int]] | None = None


@dataclass
class PrefixHit:
    """A prefix-cache hit of ``num_blocks`` blocks over several KV cache groups: group g takes
    ``blocks[g]`` as its entries from ``skip[g]`` on (a window group only the blocks its window
    still reads at the hit's end; the entries before are ``NULL_BLOCK``)."""

    num_blocks: int
    blocks: list[list[int]]
    skip: list[int]

    def __len__(self) -> int:
        return self.num_blocks


class PartialHit(list):
    """A one-group prefix-cache hit that goes on inside a block: the full blocks' ids (the list),
    then ``block``, a cached block whose first ``tokens`` tokens are the sequence's next ones. The
    sequence takes a copy of that block (copy-on-write: the cached one stays as it is) and computes
    from its ``tokens``-th slot on: a turn that continues a conversation recomputes none of the
    tokens it shares with the block where the earlier turn's prompt ended, as a token-granular
    cache would (vLLM recomputes them: it matches whole blocks only)."""

    def __init__(self, blocks: list[int], block: int, tokens: int) -> None:
        super().__init__(blocks)
        self.block, self.tokens = block, tokens

    def __bool__(self) -> bool:
        return True


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a block's page in KV cache group ``group`` (group 0: the hash)."""
    return block_hash if group == 0 else chain_hash(block_hash, (-group,))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        windows: tuple[int | None, ...] = (None,),
        tiers: TieredStore | None = None,
        rope_switch: int | None = None,
    ):
        """``windows``: per KV cache group, its sliding window (None: full attention); ``tiers``:
        the host and disk tiers below the pool (None: evicted blocks are forgotten);
        ``rope_switch``: the model's rotary switch (``ModelSpec.rope_switch``, long-rope: a
        sequence longer than it is rotated whole by the long table), or None."""
        self.pool = BlockPool(num_blocks)
        self.tiers = tiers if tiers is not None and tiers.enabled and enable_prefix_caching else None
        self._tier_ops: list[TierOp] = []
        self.num_tier_loads = 0  # blocks loaded back from a lower tier into the pool
        self.num_tier_saves = 0  # evicted blocks read out for the lower tiers
        # Per sequence: leading blocks already written through to the tiers (or found there).
        self._saved: dict[Sequence, int] = {}
        self._pending: set[int] = set()  # keys whose saves are queued and not yet stored
        if self.tiers is not None:
            self.pool.on_evict = self._spill
            self.pool.on_reset = self.tiers.clear_host
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.windowed = [g for g, w in enumerate(self.windows) if w is not None]
        self.null_block = None
        if self.windowed:  # the page a released entry names; never handed out, never read
            (self.null_block,) = self.pool.allocate(1)
            assert self.null_block == NULL_BLOCK
        groups = len(self.windows)
        # Per group: sequence -> its block table (only sequences that hold blocks).
        self.group_tables: list[dict[Sequence, list[int]]] = [{} for _ in range(groups)]
        self.tables = self.group_tables[0]
        # Per group: sequence -> leading entries released as its window passed (window groups).
        self._passed: list[dict[Sequence, int]] = [{} for _ in range(groups)]
        self.registered: dict[Sequence, int] = {}  # leading blocks published to the prefix cache
        # With a rotary switch: the phase (0, 1) of the table each sequence's blocks were computed
        # with, from its first block to its release; its hashes' root names that phase.
        self.rope_switch = rope_switch
        self._kv_phase: dict[Sequence, int] = {}
        # (src, dst) block copies the model runner must do before the next forward (copy-on-write).
        self._copies: list[tuple[int, int]] = []
        self._forks: list[tuple[int, int]] = []  # (parent, child) seq ids since the last take
        # Per group: sequence -> first index of its block table changed since last taken: the
        # input batch rewrites only that much of its persistent copy.
        self._group_changed: list[dict[Sequence, int]] = [{} for _ in range(groups)]
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.num_partial_hits = 0  # hits that took a copy of a cached block's first tokens
        # Blocks published while the step that computes them is planned (a prompt's blocks, for the
        # requests admitted after it in that step): a whole-block hit shares them, but a copy of
        # one would be taken before the forward writes it, so no partial hit is taken from them
        # until the step's changes are handed out.
        self._computing: set[int] = set()
        self.num_window_released = 0  # blocks released because every window had passed them

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        """Pages requests can hold (the pool's, less the reserved null page)."""
        return self.pool.num_blocks - (self.null_block is not None)

    @property
    def num_used(self) -> int:
        """Pages requests hold now (or the prefix cache keeps alive by their references)."""
        return self.pool.num_used - (self.null_block is not None)

    # --- reading -------------------------------------------------------------------------------
    def block_table(self, seq: Sequence, group: int = 0) -> list[int]:
        """The sequence's blocks in ``group`` (empty when it holds none). Read it, never change it."""
        return self.group_tables[group].get(seq, [])

    def holders(self):
        """(sequence, its block table) for every sequence that holds blocks (group 0)."""
        return self.tables.items()

    def all_holders(self):
        """(group, sequence, its block table in that group) for every table held."""
        for g, tables in enumerate(self.group_tables):
            for seq, table in tables.items():
                yield g, seq, table

    def num_released(self, group: int, seq: Sequence) -> int:
        """Leading entries of ``seq``'s table in a window group released as its window passed."""
        return self._passed[group].get(seq, 0)

    def pending_changes(self, group: int = 0) -> dict[Sequence, int]:
        """What ``take_step_changes`` would hand out (a copy: checks read, they do not consume)."""
        return dict(self._group_changed[group])

    # --- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks, each chained to its parent; the root is
        salted with the cache salt and the LoRA adapter (deterministic: ``block_hash.py`` defines
        them for routers). They are a pure function of the tokens, cached on the sequence."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        parent = hashes[-1] if hashes else self.root_of(seq, self._phase_of(seq))
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes[:num_blocks]

    @staticmethod
    def root_of(seq: Sequence, rope_phase: int = 0) -> int:
        """KV computed under one adapter (or version of it), or one salt, or one rotary phase, is
        never served to another."""
        lora = seq.request.lora
        return root_hash(
            salt_hash(seq.request.cache_salt),
            None if lora is None else f"{lora.name}@{lora.version}",
            rope_phase,
        )

    # --- the rotary switch (long-rope) --------------------------------------------------------
    def rope_phase(self, seq: Sequence) -> int:
        """The rotary phase ``seq``'s length selects now: 1 past the switch, else 0."""
        return int(self.rope_switch is not None and len(seq.token_ids) > self.rope_switch)

    def _phase_of(self, seq: Sequence) -> int:
        """The phase of the blocks ``seq`` holds (of its length now when it holds none)."""
        return self._kv_phase[seq] if seq in self._kv_phase else self.rope_phase(seq)

    def needs_recompute(self, seq: Sequence) -> bool:
        """``seq`` holds blocks computed with a rotary phase its length no longer selects (it grew
        past the switch): they must all be computed again (the scheduler releases them)."""
        return seq in self._kv_phase and self._kv_phase[seq] != self.rope_phase(seq)

    def _note_phase(self, seq: Sequence) -> None:
        if self.rope_switch is not None:
            self._kv_phase[seq] = self.rope_phase(seq)

    def find_cached_prefix(self, seq: Sequence):
        """Cached blocks holding the longest prefix of ``seq`` (never its last token: that one must be
        computed so the step has logits to sample from). Nothing is taken yet. One group: the
        block ids; several: a ``PrefixHit``, whose length every group agrees on: a full group
        needs every block before it, a window group only those its window reads from there."""
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self.block_hashes(seq, max_blocks)
        if self.tiers is not None:
            pins: list[int] = []  # blocks this lookup holds, so that a load never evicts them
            try:
                found = self._find_prefix(seq, hashes, max_blocks, pins)
            finally:
                self.pool.release(pins[::-1])  # the tail first back to the LRU end
        else:
            found = self._find_prefix(seq, hashes, max_blocks, None)
        if len(self.windows) > 1:
            return found
        return self._partial(seq, hashes, found)

    def hit_length(self, hit) -> int:
        """The tokens a hit from ``find_cached_prefix`` covers (a partial block's included)."""
        return len(hit) * self.block_size + (hit.tokens if isinstance(hit, PartialHit) else 0)

    def _partial(self, seq: Sequence, hashes: list[int], found: list[int]) -> list[int]:
        """``found`` (one group's full blocks), or a ``PartialHit`` where a cached block that
        continues them starts with the sequence's next tokens (the longest such start; never the
        sequence's last token). Only blocks in the pool are looked at, not the lower tiers."""
        bs, n = self.block_size, len(found)
        limit = min(bs, seq.num_tokens - 1 - n * bs)
        if limit <= 0:
            return found
        parent = hashes[n - 1] if n else self.root_of(seq, self._phase_of(seq))
        kids = self.pool.children.get(parent)
        if not kids:
            return found
        want = seq.token_ids[n * bs : n * bs + limit]
        best, most = None, 0
        for block_id in kids:
            if block_id in self._computing:
                continue
            have = self.pool.blocks[block_id].token_ids
            m = 0
            while m < limit and have[m] == want[m]:
                m += 1
            if m > most:
                best, most = block_id, m
        return found if best is None else PartialHit(found, best, most)

    def _lookup(self, seq: Sequence, hashes: list[int], i: int, g: int, pins: list[int] | None):
        """Block ``i`` of ``seq`` in group ``g``: from the pool, else (with ``pins``) loaded from a
        lower tier into a fresh pool block; held in ``pins`` when found."""
        bs = self.block_size
        tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
        key = group_key(hashes[i], g)
        block_id = self.pool.lookup(key, tokens)
        if pins is None:
            return block_id
        if block_id is None:
            if not self.pool.num_free:
                return None
            entry = self.tiers.get(key, tokens)
            if entry is None:
                return None
            (block_id,) = self.pool.allocate(1)  # held: in pins, released after the lookup
            parent = (hashes[i - 1] if i else self.root_of(seq, self._phase_of(seq))) if g == 0 else 0
            salt_h = salt_hash(seq.request.cache_salt) if g == 0 else 0
            self.pool.register(block_id, key, tokens, parent, salt_h, listed=g == 0)
            self._tier_ops.append(TierOp(block_id, entry=entry))
            self.num_tier_loads += 1
        else:
            self.pool.touch(block_id)
        pins.append(block_id)
        return block_id

    def _spill(self, block) -> None:
        """A computed, published ``block`` goes down to the tiers: the runner reads it out before
        the next forward (unless they hold it already, or its save is queued)."""
        key = block.block_hash
        if key in self._pending or key in self.tiers:
            return
        meta = BlockMeta(key, block.token_ids, block.parent_hash, block.salt_hash, block.listed)
        self._tier_ops.append(TierOp(block.block_id, meta=meta))
        self._pending.add(key)
        self.num_tier_saves += 1

    def write_through(self, seqs) -> None:
        """Queue the saves of the blocks ``seqs`` have computed and published since the last call
        (write-through: the disk then holds a prefix as soon as it is computed, and a restart finds
        it). A block's bytes never change once it is full and published."""
        if self.tiers is None:
            return
        bs, null = self.block_size, self.null_block
        for seq in seqs:
            done = min(self.registered.get(seq, 0), seq.num_computed_tokens // bs)
            first = self._saved.get(seq, 0)
            if done <= first:  # a decode inside its last block: the common case, nothing to do
                continue
            tables = [t.get(seq) for t in self.group_tables]
            if tables[0] is None:
                continue
            for i in range(first, done):
                for table in tables:
                    block_id = table[i]
                    if block_id != null and self.pool.blocks[block_id].block_hash is not None:
                        self._spill(self.pool.blocks[block_id])
            self._saved[seq] = done

    def take_tier_ops(self) -> list[TierOp]:
        """The tier moves queued since the last step's changes were taken (the engine runs them at
        once when it goes idle, so that a restart finds every computed block on disk)."""
        ops, self._tier_ops = self._tier_ops, []
        return ops

    def store_spilled(self, entries) -> None:
        """The blocks' bytes, as the runner read them out: into the tiers."""
        for entry in entries:
            self._pending.discard(entry.meta.key)
            self.tiers.put(entry)

    def _find_prefix(self, seq: Sequence, hashes: list[int], max_blocks: int, pins: list[int] | None):
        bs = self.block_size
        if len(self.windows) == 1:
            found = []
            for i in range(len(hashes)):
                block_id = self._lookup(seq, hashes, i, 0, pins)
                if block_id is None:
                    break
                found.append(block_id)
            return found
        seen: dict[tuple[int, int], int | None] = {}

        def look(g: int, i: int) -> int | None:
            if (g, i) not in seen:
                seen[g, i] = self._lookup(seq, hashes, i, g, pins)
            return seen[g, i]

        n = max_blocks
        for g, w in enumerate(self.windows):
            if w is None:
                k = 0
                while k < n and look(g, k) is not None:
                    k += 1
                n = k
        moved = True
        while moved and n:  # a shorter hit needs other blocks of a window group: check again
            moved = False
            for g in self.windowed:
                for i in range(n - 1, self._first_read(g, n * bs) - 1, -1):
                    if look(g, i) is None:
                        n, moved = i, True
                        break
        if not n:
            return []
        skip = [0 if w is None else self._first_read(g, n * bs) for g, w in enumerate(self.windows)]
        return PrefixHit(n, [[look(g, i) for i in range(skip[g], n)] for g in range(len(self.windows))], skip)

    def _first_read(self, group: int, position: int) -> int:
        """The first block a query at ``position`` (or after it) reads in a window group."""
        return max(0, position - self.windows[group] + 1) // self.block_size

    # --- allocation ---------------------------------------------------------------------------
    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks=None, num_lookahead: int = 0
    ) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens (after any ``cached_blocks`` prefix,
        which the scheduler then counts as computed) and ``num_lookahead`` slots past them that a
        proposer writes into (a draft model's drafts; vLLM's lookahead tokens); a window group
        first releases the blocks its window has passed.

        Returns False, changing nothing else, when the pool cannot supply the blocks.
        """
        num_new_tokens += num_lookahead  # slots are slots: only the count of blocks differs
        if len(self.windows) > 1:
            return self._allocate_groups(seq, num_new_tokens, cached_blocks)
        bs = self.block_size
        start = seq.num_computed_tokens
        table = self.tables.get(seq, _NO_BLOCKS)
        if not cached_blocks and start % bs and start + num_new_tokens <= len(table) * bs:
            # The common decode case: the slots exist in the last block; only a shared one needs work.
            if self.pool.blocks[table[start // bs]].ref_count == 1:
                if self.windowed:
                    self._release_passed(seq, start)
                return True
        partial = cached_blocks if isinstance(cached_blocks, PartialHit) else None
        cached_blocks = cached_blocks or []
        if isinstance(cached_blocks, PrefixHit):
            cached_blocks = cached_blocks.blocks[0]
        start += len(cached_blocks) * bs + (partial.tokens if partial else 0)
        if self.windowed:
            self._release_passed(seq, start)
        have = len(table) + len(cached_blocks) + int(partial is not None)
        need_new = max(0, cdiv(start + num_new_tokens, bs) - have)
        # The first block written to is shared (a fork's partial prompt block): it must be copied.
        # So is a partial hit's block (below): the sequence writes into a copy of it.
        write_block = start // bs
        cow = (
            start % bs != 0
            and write_block < len(table)
            and self.pool.blocks[table[write_block]].ref_count > 1
        )
        revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        if partial is not None:
            revived += self.pool.blocks[partial.block].ref_count == 0
        if need_new + int(cow) + int(partial is not None) > self.pool.num_free - revived:
            return False
        if not need_new and not cow and not cached_blocks:
            return True
        if table is _NO_BLOCKS:
            table = self.tables[seq] = []
            self.registered[seq] = 0
            self._note_phase(seq)
        first_changed = len(table)
        if cached_blocks:
            self._take_cached(seq, 0, table, cached_blocks, 0, len(cached_blocks))
            first_changed = 0
        if partial is not None:  # held while its copy is allocated (so that it is not the copy)
            self.pool.touch(partial.block)
            table.append(partial.block)
            self._copy_on_write(table, len(table) - 1)
            self.num_partial_hits += 1
        if cow:
            first_changed = min(first_changed, write_block)
            self._copy_on_write(table, write_block)
        if need_new:
            table.extend(self.pool.allocate(need_new))
        if first_changed < len(table):
            self._note_change(seq, first_changed)
        return True

    def _allocate_groups(self, seq: Sequence, num_new: int, hit) -> bool:
        """``allocate`` over several KV cache groups: the same logical blocks in each, a window
        group's entries before its window released."""
        bs, pool = self.block_size, self.pool
        start = seq.num_computed_tokens
        if isinstance(hit, list):  # block ids of one group: no use here
            assert not hit, "a multi-group prefix hit is a PrefixHit"
            hit = None
        num_hit = len(hit) if hit else 0
        start += num_hit * bs
        self._release_passed(seq, start)
        end = cdiv(start + num_new, bs)
        write_block = start // bs
        plans, needed, revived = [], 0, 0
        for g, tables in enumerate(self.group_tables):
            table = tables.get(seq, _NO_BLOCKS)
            have = num_hit if hit else len(table)
            need_new = max(0, end - have)
            cow = (
                start % bs != 0 and write_block < len(table) and pool.blocks[table[write_block]].ref_count > 1
            )
            if hit:
                revived += sum(1 for b in hit.blocks[g] if pool.blocks[b].ref_count == 0)
            needed += need_new + int(cow)
            plans.append((table, need_new, cow))
        if needed > pool.num_free - revived:
            return False
        if not needed and not hit:
            return True
        if seq not in self.registered:
            self.registered[seq] = 0
            self._note_phase(seq)
        # Every group's hit blocks are taken before any group allocates: a hit block still free
        # (ref count 0, at the LRU end) would otherwise be evicted by an earlier group's allocation
        # and handed out twice (as that group's new page and as this group's cached one).
        for g, (table, need_new, cow) in enumerate(plans):
            if table is _NO_BLOCKS:
                table = self.group_tables[g][seq] = []
                plans[g] = (table, need_new, cow)
            if hit:
                self._take_cached(seq, g, table, hit.blocks[g], hit.skip[g], num_hit)
        for g, (table, need_new, cow) in enumerate(plans):
            first_changed = 0 if hit else len(table)
            if cow:
                first_changed = min(first_changed, write_block)
                self._copy_on_write(table, write_block)
            if need_new:
                table.extend(pool.allocate(need_new))
            if first_changed < len(table):
                self._note_change(seq, first_changed, g)
        return True

    def _copy_on_write(self, table: list[int], write_block: int) -> None:
        (copy,) = self.pool.allocate(1)
        old = table[write_block]
        if self.tiers is not None:  # in order with the tiers' moves (kv_tiers/transfer.py)
            self._tier_ops.append(TierOp(copy, src=old))
        else:
            self._copies.append((old, copy))
        self.pool.release([old])
        table[write_block] = copy

    def _release_passed(self, seq: Sequence, start: int) -> None:
        """Window groups: release the blocks no query from position ``start`` on can read (the
        counter only moves forward while a sequence holds blocks, so none is read again)."""
        for g in self.windowed:
            table = self.group_tables[g].get(seq)
            if table is None:
                continue
            passed = self._passed[g]
            done = passed.get(seq, 0)
            first = min(self._first_read(g, start), len(table))
            if first <= done:
                continue
            self.pool.release(table[done:first])
            table[done:first] = [NULL_BLOCK] * (first - done)
            passed[seq] = first
            self.num_window_released += first - done
            self._note_change(seq, done, g)

    def _take_cached(
        self, seq: Sequence, group: int, table: list[int], blocks: list[int], skip: int, n: int
    ) -> None:
        assert not table and seq.num_computed_tokens == 0
        for block_id in blocks:
            self.pool.touch(block_id)
        table.extend([NULL_BLOCK] * skip)
        table.extend(blocks)
        if skip:
            self._passed[group][seq] = skip
        self.registered[seq] = n

    def note_admission(self, seq: Sequence, hit_tokens: int) -> None:
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += hit_tokens

    def register_computed_blocks(self, seq: Sequence, upto: int | None = None, scheduled: int = 0) -> None:
        """Publish the full blocks of the tokens computed, plus ``scheduled`` more that this step
        computes (those wholly before token ``upto`` only, when given: a draft model's cache may lag
        one token), so that later requests can reuse them. The scheduler publishes a prompt's blocks
        as soon as it schedules them: every layer writes the step's K/V before any attention reads
        it, so a request admitted later in the same step may already share them. Each group's
        page is published under its own key (``group_key``); a window group's released entries
        were published before they were released."""
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
        hashes = self.block_hashes(seq, full)
        salt_h = salt_hash(seq.request.cache_salt)
        tables = [t[seq] for t in self.group_tables]
        null = self.null_block  # None: no group releases entries
        for i in range(done, full):
            parent = hashes[i - 1] if i else self.root_of(seq, self._phase_of(seq))
            block_tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if tables[0][i] != null:
                self.pool.register(tables[0][i], hashes[i], block_tokens, parent, salt_h)
                if (i + 1) * bs > seq.num_computed_tokens:  # computed by the step being planned
                    self._computing.add(tables[0][i])
            for g in range(1, len(tables)):
                block_id = tables[g][i]
                if block_id != null:
                    self.pool.register(block_id, group_key(hashes[i], g), block_tokens, listed=False)
        self.registered[seq] = full

    def trim(self, seq: Sequence, extra: int = 0) -> None:
        """Release the blocks past the next token's slot (and ``extra`` slots after it): lookahead
        slots of rejected drafts, and those that no proposal still needs."""
        keep = cdiv(len(seq.token_ids) + extra, self.block_size)
        for g, tables in enumerate(self.group_tables):
            table = tables.get(seq, _NO_BLOCKS)
            if len(table) > keep:
                self.pool.release([b for b in reversed(table[keep:]) if b != self.null_block])
                del table[keep:]
                self._note_change(seq, keep, g)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` by reference (its counter is the scheduler's)."""
        for g, tables in enumerate(self.group_tables):
            table = tables.get(parent, [])
            for block_id in table:
                if block_id != self.null_block:
                    self.pool.touch(block_id)
            tables[child] = list(table)
            if parent in self._passed[g]:
                self._passed[g][child] = self._passed[g][parent]
            self._note_change(child, 0, g)
        self.registered[child] = self.registered.get(parent, 0)
        if parent in self._kv_phase:
            self._kv_phase[child] = self._kv_phase[parent]
        self._forks.append((parent.seq_id, child.seq_id))

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; the scheduler resets its counter."""
        if self.tiers is not None:
            self.write_through((seq,))
            self._saved.pop(seq, None)
        self.registered.pop(seq, None)
        if self._kv_phase.pop(seq, None) not in (None, self.rope_phase(seq)):
            seq.block_hashes.clear()  # hashes of the old phase's blocks: the next lookup chains anew
        for g, tables in enumerate(self.group_tables):
            table = tables.pop(seq, None)
            self._passed[g].pop(seq, None)
            if table is None:
                continue
            # Tail blocks first, so that they are evicted before the (more shareable) head of the prefix.
            if self.null_block is not None:
                table = [b for b in table if b != NULL_BLOCK]
            self.pool.release(list(reversed(table)))
            self._note_change(seq, 0, g)

    def _note_change(self, seq: Sequence, first: int, group: int = 0) -> None:
        changed = self._group_changed[group]
        if first < changed.get(seq, first + 1):
            changed[seq] = first

    # --- handing the step's changes out ---------------------------------------------------------
    def take_step_changes(self) -> StepChanges:
        """The changes since the last take, as they stand now (a sequence freed and re-admitted in
        between simply gets its new table); each is handed out once."""
        updates, released = [], []
        for g, changed in enumerate(self._group_changed):
            tables = self.group_tables[g]
            for seq, first in changed.items():
                table = tables.get(seq)
                if table is None:
                    if g == 0:
                        released.append(seq.seq_id)
                else:
                    updates.append(BlockUpdate(seq.seq_id, first, table[first:], g))
            self._group_changed[g] = {}
        if self._copies:
            copies = np.array(self._copies, dtype=np.int64).reshape(len(self._copies), 2)
            self._copies = []
        else:
            copies = _NO_COPIES
        tier_ops, self._tier_ops = self._tier_ops or None, []
        forks, self._forks = self._forks or None, []
        self._computing.clear()  # written by this step's forward, before the next step's copies
        return StepChanges(updates, released, copies, tier_ops, forks)
