"""Random inputs for kernel checks, shared by the CPU tests and the GPU check.

A paged batch is built the way the engine builds one: each request's context is scattered over
shuffled, non-contiguous physical blocks, its K/V for the whole context are already in the cache,
and the query tokens are the last ``q_len`` positions of that context (a prefill chunk after a
cached prefix when ``q_len < seq_len``, a decode when ``q_len == 1``).

A case may name a layer's sliding ``window`` and score ``softcap`` (Gemma 2/3's layers). A windowed
batch's table is then what the KV manager leaves a window group: the entries wholly before the first
block its first query's window reads are released, and name a null page (``null_block``, the
cache's last block) filled with NaN, so a kernel that reads one poisons its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionCase:
    """One paged-attention configuration: ``requests`` is a list of ``(seq_len, q_len)``."""

    requests: tuple[tuple[int, int], ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    window: int | None = None  # a sliding-window layer's width
    softcap: float | None = None  # the layer's attention-score soft-cap

    @property
    def label(self) -> str:
        reqs = ",".join(f"{s}/{q}" for s, q in self.requests)
        layer = (f"-w{self.window}" if self.window else "") + (
            f"-cap{self.softcap:g}" if self.softcap else ""
        )
        return (
            f"hq{self.num_q_heads}-hk{self.num_kv_heads}-d{self.head_dim}-bs{self.block_size}{layer}-[{reqs}]"
        )

    def layer(self) -> dict:
        """The layer's options as the kernels take them (only those it has)."""
        return {k: v for k, v in (("window", self.window), ("softcap", self.softcap)) if v is not None}


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int
    layer: dict  # window / softcap, as the kernels take them
    null_block: int | None = None  # the NaN page a windowed table's released entries name

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )

    def bounds(self) -> dict:
        return dict(max_query_len=self.max_query_len, max_seq_len=self.max_seq_len)


def make_paged_batch(
    case: AttentionCase,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    blocks_per_req = [(s + bs - 1) // bs for s, _ in case.requests]
    num_blocks = sum(blocks_per_req) + spare_blocks  # spare blocks hold garbage nobody may read
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_req) + 2  # wider than needed, as the engine's padded tables are
    tables = torch.full((len(case.requests), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        tables[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    null_block = None
    if case.window is not None:
        null_block = num_blocks
        nan_page = torch.full((1, *shape[1:]), float("nan"), dtype=dtype)
        k_cache, v_cache = torch.cat([k_cache, nan_page]), torch.cat([v_cache, nan_page])
        for b, (ctx, q_len) in enumerate(case.requests):
            tables[b, : released_entries(ctx, q_len, case.window, bs)] = null_block
    q_lens = [q for _, q in case.requests]
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn((int(qsl[-1]), case.num_q_heads, case.head_dim), generator=gen).to(dtype)
    dev = torch.device(device)
    return PagedBatch(
        q=q.to(dev),
        k_cache=k_cache.to(dev),
        v_cache=v_cache.to(dev),
        # Unused table entries point at block 0 in the engine; -1 here would fault if ever read.
        block_tables=tables.clamp(min=0).to(dev),
        seq_lens=torch.tensor([s for s, _ in case.requests], dtype=torch.int32, device=dev),
        query_start_loc=qsl.to(dev),
        scale=case.head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(s for s, _ in case.requests),
        layer=case.layer(),
        null_block=null_block,
    )


def released_entries(seq_len: int, q_len: int, window: int, block_size: int) -> int:
    """Leading table entries a window group has released for a step whose first query sits at
    ``seq_len - q_len``: the blocks wholly before that query's window (the KV manager's rule)."""
    return max(0, seq_len - q_len - window + 1) // block_size


def dense_causal_reference(batch: PagedBatch) -> torch.Tensor:
    """Attention recomputed from contiguous per-request K/V with plain SDPA, fp32 (an independent
    check of the paged reference, not built on it)."""
    out = torch.empty(batch.q.shape, dtype=torch.float32, device=batch.q.device)
    bs = batch.k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    for b, ctx in enumerate(batch.seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        blocks = batch.block_tables[b, : (ctx + bs - 1) // bs].long()
        k = batch.k_cache[blocks].reshape(-1, *batch.k_cache.shape[2:])[:ctx].float()
        v = batch.v_cache[blocks].reshape(-1, *batch.v_cache.shape[2:])[:ctx].float()
        group = batch.q.shape[1] // k.shape[1]
        q = batch.q[lo:hi].float().transpose(0, 1)  # [Hq, q_len, D]
        k = k.transpose(0, 1).repeat_interleave(group, 0)
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        # Queries are the last q_len positions; a full causal mask over the context, sliced.
        full = torch.ones(ctx, ctx, dtype=torch.bool, device=q.device).tril()
        mask = full[ctx - (hi - lo) :]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        out[lo:hi] = o.transpose(0, 1)
    return out


# Every paged-attention configuration the CPU tests run under the interpreter (and the GPU check
# runs on CUDA): odd lengths, prefill chunks after a cached prefix, decodes, GQA 1/4/8, head dims
# 64/128, block sizes 16/32. Shapes are tiny so the interpreter stays fast.
MIXED_CASES: tuple[AttentionCase, ...] = (
    AttentionCase(((7, 7), (1, 1), (40, 1), (53, 19)), 4, 4, 64, 16),
    AttentionCase(((33, 5), (70, 1), (17, 17), (100, 3)), 8, 2, 64, 32),
    AttentionCase(((129, 41), (9, 1), (64, 64)), 8, 1, 128, 16),
    AttentionCase(((45, 45), (77, 2), (31, 1)), 4, 1, 128, 32),
)
# Decode-only batches with contexts long enough that the split-KV path is taken.
SPLIT_DECODE_CASES: tuple[AttentionCase, ...] = (
    AttentionCase(((613, 1), (5, 1), (300, 1)), 8, 1, 64, 16),
    AttentionCase(((1029, 1), (700, 1)), 4, 4, 128, 32),
    AttentionCase(((777, 1),), 16, 2, 64, 32),
)
# Sliding-window and soft-capped layers (Gemma 2/3). The windows: smaller than the context, equal to
# it (16/1 with window 16) and larger (7/7, 5/5); prefill chunks whose tiles straddle the window's
# edge (53/19, 90/70: the chunk's first rows see keys its last rows no longer do); decodes past the
# window; windows not a multiple of the block size; released entries (the NaN page) in every table
# whose window has passed a block. Soft-caps alone and with a window, as Gemma 2's layers have them.
WINDOW_CASES: tuple[AttentionCase, ...] = (
    AttentionCase(((7, 7), (16, 1), (40, 1), (53, 19), (90, 70)), 4, 2, 64, 16, window=16),
    AttentionCase(((33, 5), (70, 1), (5, 5), (100, 3)), 8, 1, 128, 32, window=20),
    AttentionCase(((33, 5), (70, 1), (17, 17), (100, 3)), 8, 2, 64, 32, softcap=2.0),
    AttentionCase(((9, 1), (61, 30), (45, 45)), 4, 4, 64, 16, window=24, softcap=5.0),
)
# Windowed / soft-capped decode batches long enough to split: the slices cover only the window (one
# request's whole context, shorter than it; a slice past a short context stays empty).
WINDOW_SPLIT_CASES: tuple[AttentionCase, ...] = (
    AttentionCase(((613, 1), (5, 1), (300, 1)), 8, 1, 64, 16, window=520),
    AttentionCase(((777, 1),), 16, 2, 64, 32, softcap=30.0),
    AttentionCase(((1029, 1), (700, 1)), 4, 4, 128, 32, window=600, softcap=50.0),
)
