"""Store one step's K and V into the paged cache: one program per token, both tensors at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_slot,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_pos,
    stride_kc_head,
    stride_vc_block,
    stride_vc_pos,
    stride_vc_head,
    block_size,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token * stride_slot).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block, pos = slot // block_size, slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(
        k_cache_ptr + block * stride_kc_block + pos * stride_kc_pos + heads * stride_kc_head + dims,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + block * stride_vc_block + pos * stride_vc_pos + heads * stride_vc_head + dims,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``kernels.reference.kv_write.write_kv``; caches are written in place. The
    slot mapping may be a strided view (a KV cache group's row of the step's ``[G, T]`` slots)."""
    tokens, num_heads, head_dim = k.shape
    if tokens == 0:
        return
    k, v = _dense_rows(k), _dense_rows(v)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv needs caches whose head dim is dense")
    _write_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        slot_mapping.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        k_cache.shape[1],
        num_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    # K/V are often views of a fused QKV projection: token and head strides are free, D must be dense.
    return t if t.stride(-1) == 1 else t.contiguous()
