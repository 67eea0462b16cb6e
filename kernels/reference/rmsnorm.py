"""RMSNorm with an optional fused residual add (the Llama pre-norm pattern)."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(norm(x + residual) * weight, x + residual)``; with no residual, ``x`` itself.

    The statistics are computed in fp32 and the scaled value is cast back to the input dtype
    before the weight multiply, as HF's LlamaRMSNorm does, so fp32 results match it bit for bit.
    """
    if residual is not None:
        x = x + residual
    residual_out = x
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype), residual_out
