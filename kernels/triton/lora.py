"""Batched mixed-adapter LoRA on CUDA: a gathered matmul in the manner of Punica's BGMV. Each token
reads its own adapter slot's A and B from the stacks (``token_slots[t]``, -1 = base: nothing added),
so one launch serves any mix of adapters in a step. Two kernels: shrink (``y = x @ A[s].T``, rank
columns) and expand (``out += y @ B[s].T``, accumulated into a possibly strided column slice of the
fused projection's output). fp32 accumulation. The torch twin is ``kernels.reference.lora``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.reductions import row_sum


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    y_ptr,
    in_features,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_yt,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # A base token (slot -1) reads nothing: its bounds are zero (masks stay plain comparisons).
    live = (slot >= 0).to(tl.int32)
    slot = tl.maximum(slot, 0)
    in_bound = in_features * live
    acc = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < in_bound
        x = tl.load(x_ptr + t * stride_xt + k, mask=kmask, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
            mask=(r[:, None] < rank) & kmask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += row_sum(a * x[None, :], axis=1)
    tl.store(y_ptr + t * stride_yt + r, acc, mask=r < rank)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    out_features,
    rank,
    stride_yt,
    stride_bs,
    stride_bn,
    stride_ot,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    live = (slot >= 0).to(tl.int32)
    slot = tl.maximum(slot, 0)
    nmask = n < out_features * live
    delta = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rmask = r < rank * live
        y = tl.load(y_ptr + t * stride_yt + r, mask=rmask, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
            mask=nmask[:, None] & rmask[None, :],
            other=0.0,
        ).to(tl.float32)
        delta += row_sum(b * y[None, :], axis=1)
    o_ptrs = out_ptr + t * stride_ot + n * stride_on
    base = tl.load(o_ptrs, mask=nmask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (base + delta).to(out_ptr.dtype.element_ty), mask=nmask)


def lora_apply(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    plan,
    max_rank: int,
) -> None:
    """Same contract as ``kernels.reference.lora.lora_apply``; ``plan`` is unused (the kernel
    gathers by ``token_slots``), ``max_rank`` bounds the rank columns read."""
    del plan
    tokens = x.shape[0]
    if tokens == 0 or max_rank == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert a_stack.stride(-1) == 1 and b_stack.stride(-1) == 1, "LoRA stacks must be row-contiguous"
    in_features, out_features = x.shape[1], out.shape[1]
    y = torch.empty(tokens, max_rank, dtype=torch.float32, device=x.device)
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    _lora_shrink_kernel[(tokens, triton.cdiv(max_rank, block_r))](
        x,
        a_stack,
        token_slots,
        y,
        in_features,
        max_rank,
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        y.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=min(128, triton.next_power_of_2(in_features)),
    )
    block_n = min(64, triton.next_power_of_2(out_features))
    _lora_expand_kernel[(tokens, triton.cdiv(out_features, block_n))](
        y,
        b_stack,
        token_slots,
        out,
        out_features,
        max_rank,
        y.stride(0),
        b_stack.stride(0),
        b_stack.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
