"""SiLU-and-multiply: the gated MLP's activation on a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[..., 2 * d]`` holding gate then up; returns ``silu(gate) * up`` of ``[..., d]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` is ``[..., 2 * d]`` holding gate then up; returns ``gelu_tanh(gate) * up`` (Gemma's MLP:
    transformers' ``gelu_pytorch_tanh``)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
