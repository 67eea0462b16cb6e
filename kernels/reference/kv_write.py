"""Store one step's keys and values into the paged cache, token t into slot ``slot_mapping[t]``."""

from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k, v [T, Hk, D]``; caches ``[num_blocks, block_size, Hk, D]``; slot = block * block_size + offset.

    A negative slot means "do not store" (padding tokens).
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views ``q [T, Hq, D]``, ``k, v [T, Hk, D]`` of the fused QKV projection's ``[T, (Hq + 2 Hk) D]``."""
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(t, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(t, num_kv_heads, head_dim)
    return q, k, v


def rotary_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    apply_rotary=None,
    write_kv=write_kv,
) -> torch.Tensor:
    """A layer's rotary embedding and cache write on its fused QKV rows: the rotated keys and the
    values stored (``write_kv``), the rotated queries ``[T, Hq, D]`` returned. The definition of
    the fused kernels (``kernels/cpu/native_elementwise.rotary_store_kv``); ``apply_rotary`` and
    ``write_kv`` are the bundle's own (default: the references)."""
    if apply_rotary is None:
        from kernels.reference.rotary import apply_rotary
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    q, k = apply_rotary(positions, q, k, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q
