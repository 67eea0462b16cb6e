"""Rotary embedding, neox layout: one program per token rotates all its query and key heads.

Only the rotation runs here; the frequency tables (plain, linear, llama3 scaling) are built once on
the host by ``kernels.reference.rotary`` and passed in as ``cos_sin_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    num_heads,
    half,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    src = src_ptr + token * stride_st + heads * stride_sh + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    # The reference rounds cos/sin to the activation dtype first; so do we.
    c = cos.to(x1.dtype).to(tl.float32)
    s = sin.to(x1.dtype).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dst = dst_ptr + token * stride_dt + heads * stride_dh + dims
    tl.store(dst, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(dst + half, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    stride_cache,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=dims < half, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + half + dims, mask=dims < half, other=0.0)
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        token,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        num_q_heads,
        half,
        cos,
        sin,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        token,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        num_k_heads,
        half,
        cos,
        sin,
        BLOCK_HK,
        BLOCK_HALF,
    )


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.reference.rotary.apply_rotary``: new ``q [T, Hq, D]``, ``k [T, Hk, D]``."""
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    if tokens == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        positions,
        q,
        k,
        q_out,
        k_out,
        cache,
        cache.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        num_q_heads,
        num_k_heads,
        half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
