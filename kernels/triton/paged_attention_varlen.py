"""One kernel for a whole mixed batch: prefill chunks (with a cached prefix) and decodes alike.

Grid: (query tiles, KV heads). A query tile is ``BLOCK_Q`` consecutive query tokens of one request
times the ``GROUP`` query heads that share a KV head, so K/V are read once per group (GQA/MQA).
The tiles of every request are numbered back to back without a device-side prefix sum: request b's
first tile is ``query_start_loc[b] // BLOCK_Q + b``, which leaves room for its ``ceil(q_len / BLOCK_Q)``
tiles and bounds the grid by ``T // BLOCK_Q + B`` -- all host-side numbers.

A sliding-window layer's tile starts its walk at the first key its first query sees
(``q_pos - window + 1``), so the blocks the window has passed are never read; later rows of the
tile mask the keys their own windows have passed. Soft-capped scores: ``attention_tiles``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.attention_tiles import (
    MAX_FLOOR,
    attend_kv_range,
    dot_precision,
    group_rows,
    score_scales,
)

BLOCK_M_PREFILL = 64  # query rows per tile when the batch holds prefill chunks
TILE_N = 64  # keys per inner step (may span several cache blocks)


@triton.jit
def _find_request(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # The last request whose first tile is <= tile (binary search over query_start_loc).
    lo = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    return lo


@triton.jit
def _varlen_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    qk_scale,
    cap_scale,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_table,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(qsl_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    first_q = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_off = first_q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows < BLOCK_Q * GROUP_PAD) & (rows % GROUP_PAD < GROUP) & (q_off < q_len)
    token = (q_start + q_off).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    io_mask = row_ok[:, None] & (dims < head_dim)[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    # Query i of the chunk sits at context position ctx - q_len + i and sees keys up to it.
    q_pos = ctx - q_len + q_off
    kv_hi = ctx - q_len + tl.minimum(first_q + BLOCK_Q, q_len)
    kv_lo = 0
    if WINDOWED:  # the first key the tile's first query sees; nothing before it is read
        kv_lo = tl.maximum(ctx - q_len + first_q - window + 1, 0)

    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], MAX_FLOOR, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc, m_i, l_i = attend_kv_range(
        q,
        q_pos,
        acc,
        m_i,
        l_i,
        k_cache_ptr,
        v_cache_ptr,
        tables_ptr + seq.to(tl.int64) * stride_table,
        kv_head,
        kv_lo,
        kv_hi,
        qk_scale,
        cap_scale,
        window,
        stride_kb,
        stride_kp,
        stride_kh,
        stride_vb,
        stride_vp,
        stride_vh,
        head_dim,
        BLOCK_SIZE,
        TILE_N,
        HEAD_PAD,
        True,
        WINDOWED,
        SOFTCAP,
        DOT_PRECISION,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def varlen_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention for any mix of prefill chunks and decodes (contract of the reference)."""
    tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    group, group_pad = group_rows(num_q_heads, k_cache.shape[2])
    out = torch.empty_like(q) if out is None else out
    if tokens == 0 or num_seqs == 0:
        return out
    if max_query_len <= 1:
        block_q = 1  # decodes only: one token per tile, the rows are the query-head group
    else:
        block_q = min(max(1, BLOCK_M_PREFILL // group_pad), triton.next_power_of_2(max_query_len))
    block_m = max(16, block_q * group_pad)
    grid = (tokens // block_q + num_seqs, k_cache.shape[2])
    qk_scale, cap_scale = score_scales(scale, softcap)
    _varlen_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        qk_scale,
        cap_scale,
        window or 0,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        head_dim,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=TILE_N,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out
