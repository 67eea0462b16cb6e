"""KV cache groups (engine_svc/kv_groups.py): sliding-window layers keep only the blocks their window
reads. Model-free checks of the manager (release as the window passes, the pool's ref counts, the
window-aware prefix hit, forks), and the kernels' side: a released entry (the null page, filled
with NaN here) is never read by the native attention (decode and chunk tiles) or the reference."""

from __future__ import annotations

import pytest
import torch

from engine_svc.kv_cache_manager import KVCacheManager, PrefixHit
from engine_svc.kv_groups import NULL_BLOCK, kv_layout
from engine_svc.sampling_params import SamplingParams
from engine_svc.sequence import Request, Sequence


def test_layout_of_gemma3_270m_and_of_a_uniform_model():
    windows = [512 if (i + 1) % 6 else None for i in range(18)]  # layers 5, 11, 17 global
    layout = kv_layout(tuple(windows))
    assert layout.slots == 3 and len(layout.groups) == 6
    assert layout.groups[0].window is None and layout.groups[0].layers == (5, 11, 17)
    assert all(g.window == 512 and len(g.layers) == 3 for g in layout.groups[1:])
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(18))
    # 4096 tokens, blocks of 16, steps of 2048 tokens at most: 256 + 5 * 161 pages of 3 layers
    assert layout.blocks_per_seq(4096, 16, 2048) == 256 + 5 * 161
    uniform = kv_layout((None,) * 4)
    assert uniform.slots == 4 and len(uniform.groups) == 1 and not uniform.windowed


def _seq(tokens, seq_id=0):
    request = Request(f"r{seq_id}", list(tokens), SamplingParams(max_tokens=100), 0, None, seq_id, 100)
    return Sequence(request, 0, list(tokens))


def _check(kv: KVCacheManager, seqs) -> None:
    """The pool's ref counts are exactly the tables' references (and the null page's one)."""
    refs = {NULL_BLOCK: 1}
    for _, _, table in kv.all_holders():
        for b in table:
            if b != NULL_BLOCK:
                refs[b] = refs.get(b, 0) + 1
    kv.pool.check_invariants(refs)


W, BS = 32, 16


def _compute(kv, seq, n):
    assert kv.allocate(seq, n)
    kv.register_computed_blocks(seq, scheduled=n)
    seq.num_computed_tokens += n


def test_window_group_releases_the_blocks_its_window_passed():
    kv = KVCacheManager(200, BS, True, (None, W, W))
    seq = _seq(range(300))
    _compute(kv, seq, 100)  # a chunk over the window boundary: every block it reads is held
    assert all(NULL_BLOCK not in kv.block_table(seq, g) for g in range(3))
    for _ in range(150):  # decodes
        _compute(kv, seq, 1)
        _check(kv, [seq])
        start = seq.num_computed_tokens - 1  # the last step's first query position
        for g in (1, 2):
            table = kv.block_table(seq, g)
            held = [i for i, b in enumerate(table) if b != NULL_BLOCK]
            # exactly the blocks a query from `start` on reads: from (start - W + 1) // BS
            assert held == list(range(max(0, start - W + 1) // BS, len(table)))
        assert NULL_BLOCK not in kv.block_table(seq, 0)
    assert kv.num_window_released > 0
    assert len(kv.block_table(seq, 1)) == len(kv.block_table(seq, 0)) == -(-250 // BS)
    used_before = kv.num_used
    kv.free(seq)
    assert kv.num_used == 0 and used_before < 3 * -(-250 // BS)
    _check(kv, [])


def test_prefix_hit_takes_only_the_window_blocks_and_is_shortened_when_they_are_gone():
    kv = KVCacheManager(200, BS, True, (None, W))
    tokens = list(range(1000, 1200))
    a = _seq(tokens)
    _compute(kv, a, 200)
    _compute(kv, a, 0)  # (the next allocation releases what the window passed)
    kv.free(a)
    b = _seq(tokens[:150] + [7] * 30, seq_id=1)
    hit = kv.find_cached_prefix(b)
    assert isinstance(hit, PrefixHit) and len(hit) == 150 // BS  # 9 blocks
    assert hit.skip == [0, max(0, 9 * BS - W + 1) // BS] and len(hit.blocks[1]) == 9 - hit.skip[1]
    # Evict the window page at the hit's end: the hit shortens to where the window's blocks are cached.
    page = kv.pool.cached.pop(kv.pool.blocks[hit.blocks[1][-1]].block_hash)
    kv.pool.blocks[page].block_hash = None
    shorter = kv.find_cached_prefix(b)
    assert 0 < len(shorter) < 9
    n = len(shorter)
    assert all(b_ is not None for b_ in shorter.blocks[1]) and len(shorter.blocks[1]) == n - shorter.skip[1]
    assert kv.allocate(b, 10, shorter)
    b.num_computed_tokens = n * BS
    assert kv.block_table(b, 1)[: shorter.skip[1]] == [NULL_BLOCK] * shorter.skip[1]
    assert kv.block_table(b, 0)[:n] == shorter.blocks[0]
    _check(kv, [b])
    kv.free(b)
    _check(kv, [])


def test_a_hit_takes_every_group_s_pages_before_any_group_allocates():
    """A prefix hit whose window pages are free at the LRU end, and new blocks to allocate: group
    0's allocation must not evict group 1's hit page (it did: the page was then group 0's new block
    and group 1's cached one at once, and a Gemma 2 request diverged from its solo run). The pool
    has no spare page: every allocation evicts."""
    kv = KVCacheManager(1 + 4 + 4, BS, True, (None, W))  # the null page, 4 pages a group
    tokens = list(range(1000, 1064))
    a = _seq(tokens)
    _compute(kv, a, 64)
    kv.free(a)  # group 0's pages, then group 1's, each tail first: group 1's block 3 is evicted first
    b = _seq(tokens + [7] * 10, seq_id=1)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 4 and hit.skip == [0, 2]
    # the case: past group 0's own hit pages, the hit's last window page is the next to evict
    assert next(p for p in kv.pool.free if p not in hit.blocks[0]) == hit.blocks[1][-1]
    assert kv.allocate(b, 10, hit)
    tables = [kv.block_table(b, g) for g in range(2)]
    assert tables[0][:4] == hit.blocks[0] and tables[1][2:4] == hit.blocks[1]
    pages = [p for t in tables for p in t if p != NULL_BLOCK]
    assert len(pages) == len(set(pages)) == 4 + 1 + 2 + 1, f"a page handed out twice: {tables}"
    _check(kv, [b])
    kv.free(b)
    _check(kv, [])


def test_fork_shares_window_pages_and_copies_on_write():
    kv = KVCacheManager(100, BS, False, (None, W))
    parent = _seq(range(70))
    _compute(kv, parent, 70)
    _compute(kv, parent, 0)
    child = _seq(range(70), seq_id=1)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    _check(kv, [parent, child])
    kv.take_step_changes()
    assert kv.allocate(child, 1)  # position 70 is in a shared partial block: copied in both groups
    copies = kv.take_step_changes().copies
    assert len(copies) == 2
    _check(kv, [parent, child])
    for s in (parent, child):
        kv.free(s)
    _check(kv, [])


@pytest.mark.parametrize("window", [5, 16, 21])
def test_kernels_never_read_a_released_entry(window):
    """Entries before each row's window point at a NaN page: any read of it would poison the row
    (0 x NaN). The native kernel (decode path and chunk tiles) and the reference give finite
    results, equal to those from tables that hold real blocks there."""
    from kernels.cpu import native_attention
    from kernels.reference import paged_attention as reference

    torch.manual_seed(window)
    blocks, bs, hk, hq, d = 48, 4, 2, 4, 16
    k_cache, v_cache = torch.randn(blocks, bs, hk, d), torch.randn(blocks, bs, hk, d)
    k_cache[NULL_BLOCK] = v_cache[NULL_BLOCK] = float("nan")
    q_lens, ctx = [1, 9, 12, 1], [30, 37, 12, 3]  # decodes and chunks, past the window and not
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    real = (torch.randperm(blocks - 1, dtype=torch.int32)[:40] + 1).view(4, 10)
    released = real.clone()
    for b, (n, c) in enumerate(zip(q_lens, ctx, strict=True)):
        released[b, : max(0, c - n + 1 - window) // bs] = NULL_BLOCK
    assert (released == NULL_BLOCK).any()
    q = torch.randn(int(qsl[-1]), hq, d)
    lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.paged_attention(q, k_cache, v_cache, real, lens, qsl, 0.3, window=window)
    got = reference.paged_attention(q, k_cache, v_cache, released, lens, qsl, 0.3, window=window)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    if native_attention.library() is None:
        pytest.skip("no native attention build here (no C compiler)")
    args = (q, k_cache, v_cache)
    native_real = native_attention.paged_attention(*args, real, lens, qsl, 0.3, window=window, isa=None)
    native = native_attention.paged_attention(*args, released, lens, qsl, 0.3, window=window, isa=None)
    assert torch.isfinite(native).all() and torch.equal(native, native_real)
