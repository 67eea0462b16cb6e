"""Decode attention with the context split across programs, then merged by log-sum-exp.

A batch of decodes has one query token per request: with few requests the varlen grid has too few
programs to keep the device busy while each walks a long context. Here each (request, KV head,
split) program covers one slice of the context and leaves a normalised partial output and its
log-sum-exp; a second kernel weighs the partials by ``exp(lse_s - max lse)`` into the result.

A sliding-window layer splits only the keys its window sees (the last ``window`` of the context):
slice s covers ``[kv_start + s * split_len, ...)`` with ``kv_start = max(0, seq_len - window)``, so
the number of slices follows the window, not the context, and the blocks the window has passed are
never read. Soft-capped scores: ``attention_tiles``.
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
from kernels.triton.reductions import row_max, row_sum

TILE_N = 64
MIN_SPLIT_TOKENS = 256  # a slice shorter than this costs more to merge than it saves
MAX_SPLITS = 32


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, target_programs: int) -> int:
    """How many slices each decode's context is cut into: enough programs to fill the device
    (``target_programs``), never slices shorter than ``MIN_SPLIT_TOKENS``; 1 means do not split."""
    by_length = max_seq_len // MIN_SPLIT_TOKENS
    by_occupancy = triton.cdiv(target_programs, max(1, num_seqs * num_kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


@triton.jit
def _split_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_lse_ptr,
    tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    qk_scale,
    cap_scale,
    window,
    split_len,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_table,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) == q_start:  # no query this step
        return
    ctx = tl.load(seq_lens_ptr + seq)
    kv_start = 0
    if WINDOWED:  # only the window's keys are split; nothing before them is read
        kv_start = tl.maximum(ctx - window, 0)
    kv_lo = kv_start + split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, ctx)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_PAD)
    io_mask = row_ok[:, None] & (dims < head_dim)[None, :]
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], MAX_FLOOR, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    # The one query sits at the last context position, so every key in [kv_lo, kv_hi) is visible
    # (its window's too: kv_lo >= kv_start): no mask beyond the range.
    acc, m_i, l_i = attend_kv_range(
        q,
        rows,
        acc,
        m_i,
        l_i,
        k_cache_ptr,
        v_cache_ptr,
        tables_ptr + seq * stride_table,
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
        False,
        False,
        SOFTCAP,
        DOT_PRECISION,
    )
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # base 2
    tl.store(
        part_out_ptr
        + seq * stride_po_seq
        + head[:, None] * stride_po_head
        + split * stride_po_split
        + dims[None, :],
        out,
        mask=io_mask,
    )
    tl.store(part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    qsl_ptr,
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_ot,
    stride_oh,
    head_dim,
    SPLITS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) == q_start:
        return
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    split_ok = splits < num_splits
    lse = tl.load(
        part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + splits,
        mask=split_ok,
        other=float("-inf"),
    )
    top = row_max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty slices weigh 0
    part = tl.load(
        part_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + splits[:, None] * stride_po_split
        + dims[None, :],
        mask=split_ok[:, None] & (dims < head_dim)[None, :],
        other=0.0,
    )
    total = row_sum(weight, axis=0)
    out = row_sum(part * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


def split_kv_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention for a batch where every request has at most one query token (``window``:
    a sliding-window layer's width; ``max_seq_len`` bounds the keys split either way)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    group, group_pad = group_rows(num_q_heads, num_kv_heads)
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    span = max_seq_len if window is None else min(max_seq_len, window)  # keys any request reads
    split_len = triton.cdiv(triton.cdiv(span, num_splits), TILE_N) * TILE_N
    num_splits = triton.cdiv(span, split_len)
    qk_scale, cap_scale = score_scales(scale, softcap)
    part_out = torch.empty(
        (num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        query_start_loc,
        qk_scale,
        cap_scale,
        window or 0,
        split_len,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        head_dim,
        GROUP=group,
        BLOCK_M=max(16, group_pad),
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=TILE_N,
        HEAD_PAD=head_pad,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    _merge_splits_kernel[(num_seqs, num_q_heads)](
        part_out,
        part_lse,
        out,
        query_start_loc,
        num_splits,
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        out.stride(0),
        out.stride(1),
        head_dim,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_PAD=head_pad,
        num_warps=4,
    )
    return out
