"""RMSNorm with the residual add fused in: one program per token row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.reductions import row_sum


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, exactly as `x + residual` in torch.
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = row_sum(h * h, axis=0) / hidden
    normed = (h * tl.rsqrt(variance + eps)).to(x.dtype)
    # HF casts back to the activation dtype before the weight multiply; keep that rounding step.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.reference.rmsnorm.rms_norm`` for ``x [T, H]``."""
    x = _rows_contiguous(x)
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        residual = _rows_contiguous(residual)
        residual_out = torch.empty_like(x)
    else:
        residual_out = x
    rows = x.shape[0]
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight.contiguous(),
        out,
        residual_out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return out, residual_out


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Rows may be strided (views into a bigger buffer); only the hidden dim must be dense.
    return t if t.stride(-1) == 1 else t.contiguous()


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))
