"""Hypothesis drives the KV cache manager through allocate / append / share / free / evict / abort;
after every step the pool must be whole and every ref count must equal its real holders."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_svc.kv_cache_manager import KVCacheManager
from engine_svc.sampling_params import SamplingParams
from engine_svc.sequence import Request, Sequence

BLOCK = 4
NUM_BLOCKS = 12


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.arrivals = 0

    def _new_seq(self, tokens: list[int]) -> Sequence:
        self.arrivals += 1
        req = Request(str(self.arrivals), tokens, SamplingParams(), 0, None, self.arrivals, 16)
        return Sequence(req, 0, list(tokens))

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def admit(self, tokens):
        """A new sequence: reuse what the prefix cache holds, allocate the rest, compute it all."""
        seq = self._new_seq(tokens)
        cached = self.kv.find_cached_prefix(seq)
        need = seq.num_tokens - len(cached) * BLOCK
        if self.kv.allocate(seq, need, cached):
            seq.num_computed_tokens = len(cached) * BLOCK + need  # the counter is the scheduler's
            self.kv.register_computed_blocks(seq)
            self.live.append(seq)
        else:
            assert self.kv.block_table(seq) == [] and seq.num_computed_tokens == 0

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        """Decode one token (copy-on-write if its block is shared)."""
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.kv.allocate(seq, 1):
            seq.num_computed_tokens += 1
            self.kv.register_computed_blocks(seq)
        else:
            seq.token_ids.pop()
        self.kv.take_step_changes()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def share(self, data):
        """Fork (parallel sampling): the child holds the parent's blocks by reference."""
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence(parent.request, 1, list(parent.token_ids))
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        """Finish or abort a sequence: every block reference it held goes back."""
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0

    @rule(count=st.integers(1, NUM_BLOCKS))
    def evict_by_pressure(self, count):
        """Allocating fresh blocks evicts cached ones in LRU order; then they are given back."""
        got = self.kv.pool.allocate(count)
        if got is not None:
            assert all(self.kv.pool.blocks[b].block_hash is None for b in got)
            self.kv.pool.release(got)

    @invariant()
    def pool_is_whole(self):
        holders: dict[int, int] = {}
        for seq in self.live:
            for b in self.kv.block_table(seq):
                holders[b] = holders.get(b, 0) + 1
        self.kv.pool.check_invariants(holders)
        for seq in self.live:
            assert len(self.kv.block_table(seq)) * BLOCK >= seq.num_computed_tokens
        assert {s.seq_id for s, _ in self.kv.holders()} <= {s.seq_id for s in self.live}

    def teardown(self):
        for seq in self.live:
            self.kv.free(seq)
        self.kv.pool.check_invariants({})
        assert self.kv.pool.num_free == NUM_BLOCKS


TestKVCacheStateMachine = KVCacheMachine.TestCase
TestKVCacheStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hit_requires_equal_tokens():
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=True)
    machine_seq = Sequence(Request("a", [1, 2, 3, 4, 5], SamplingParams(), 0, None, 0, 4), 0, [1, 2, 3, 4, 5])
    assert kv.allocate(machine_seq, 5)
    machine_seq.num_computed_tokens = 5
    kv.register_computed_blocks(machine_seq)
    same = Sequence(Request("b", [1, 2, 3, 4, 9], SamplingParams(), 0, None, 1, 4), 0, [1, 2, 3, 4, 9])
    assert kv.find_cached_prefix(same) == kv.block_table(machine_seq)[:1]
    # A forged hash collision: the stored tokens differ, so the hit is refused.
    block = kv.pool.blocks[kv.block_table(machine_seq)[0]]
    block.token_ids = (9, 9, 9, 9)
    assert kv.find_cached_prefix(same) == []
    # Another tenant's salt never reaches this tenant's blocks.
    block.token_ids = (1, 2, 3, 4)
    salted = Sequence(
        Request("c", [1, 2, 3, 4, 9], SamplingParams(), 0, "tenant-b", 2, 4), 0, [1, 2, 3, 4, 9]
    )
    assert kv.find_cached_prefix(salted) == []


def test_last_prompt_token_is_always_computed():
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=True)
    first = Sequence(Request("a", list(range(8)), SamplingParams(), 0, None, 0, 4), 0, list(range(8)))
    assert kv.allocate(first, 8)
    first.num_computed_tokens = 8
    kv.register_computed_blocks(first)
    again = Sequence(Request("b", list(range(8)), SamplingParams(), 0, None, 1, 4), 0, list(range(8)))
    assert len(kv.find_cached_prefix(again)) == 1  # 2 full blocks cached, but the last token must be computed
