"""The inner loop shared by both paged-attention kernels: online softmax over one KV range.

A tile of ``BLOCK_M`` query rows (query tokens x the query heads of one KV head) walks the keys
``[kv_lo, kv_hi)`` of one request, ``TILE_N`` at a time. Key position n lives in physical block
``block_table[n // BLOCK_SIZE]`` at offset ``n % BLOCK_SIZE``, so a tile may span several blocks
and the blocks may sit anywhere in the cache. Scores are kept in base 2 (``qk_scale`` includes
log2(e)) so the exponentials are ``exp2``.

Two per-layer options, each a constexpr so that a layer without it compiles the loop of before:

- ``WINDOWED``: a sliding-window layer (width ``window``) masks the keys at or before
  ``q_pos - window``; the callers also start ``kv_lo`` at the tile's first visible key, so the
  blocks a window has passed (released by the KV manager: a null page in the table) are never read.
- ``SOFTCAP``: soft-capped scores (Gemma 2), ``cap * tanh(s / cap)`` on the scaled score before the
  mask. Then ``qk_scale`` is ``scale / cap`` and ``cap_scale`` is ``cap * log2(e)``: the tanh takes
  the natural-units score over the cap, and its result goes to base 2 after.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from kernels.triton.reductions import row_max, row_sum

# Masked scores; the running maximum starts at a finite floor instead, so a row that has seen only
# masked keys gets exp2(-inf - floor) = 0 rather than exp2(-inf + inf) = nan.
MAX_FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def tanh(x):
    """tanh from exp2, stable at both ends (the interpreter has no libdevice tanh): the sign of x
    times (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1]."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # -2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def attend_kv_range(
    q,
    q_pos,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
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
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < head_dim
    for start in range(kv_lo, kv_hi, TILE_N):
        n = start + tl.arange(0, TILE_N)
        key_ok = n < kv_hi
        block = tl.load(table_ptr + n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = (n % BLOCK_SIZE).to(tl.int64)
        k_off = block * stride_kb + offset * stride_kp + kv_head * stride_kh
        v_off = block * stride_vb + offset * stride_vp + kv_head * stride_vh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0
        )
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = tanh(s) * cap_scale
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, row_max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + row_sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + v_off[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def dot_precision(dtype) -> str:
    """fp32 inputs keep full precision (the default would be tf32 on NVIDIA tensor cores)."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


def score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(``qk_scale``, ``cap_scale``) for ``attend_kv_range``: base-2 scores, or with a soft-cap the
    dot product over the cap (tanh's argument) and the cap in base 2 (what tanh's result is
    multiplied by)."""
    if softcap is None:
        return scale * math.log2(math.e), 1.0
    return scale / softcap, softcap * math.log2(math.e)


def group_rows(num_q_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads per KV head, that count rounded up to a power of two for row indexing)."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    return group, triton.next_power_of_2(group)
