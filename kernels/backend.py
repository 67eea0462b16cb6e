"""The one switch between the Triton kernels and their torch twins.

The engine calls only ``Kernels`` methods; which implementation runs is decided once, by device
(Triton on CUDA, torch elsewhere) unless the config names one, and is logged.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kernels.cpu import native_attention as cpu_paged_attention
from kernels.cpu import native_elementwise
from kernels.interface import Kernels
from kernels.reference import activation, kv_write, paged_attention, rmsnorm, rotary

log = logging.getLogger(__name__)

BACKENDS = ("torch", "triton", "reference")


# The plain-torch twins exactly as written: the definition of every kernel.
REFERENCE_KERNELS = Kernels(
    name="reference",
    rms_norm=rmsnorm.rms_norm,
    silu_and_mul=activation.silu_and_mul,
    apply_rotary=rotary.apply_rotary,
    write_kv=kv_write.write_kv,
    paged_attention=paged_attention.paged_attention,
)

# The torch path the engine runs off CUDA: the references, except where native CPU kernels with
# the same results are faster: attention reading the blocks in place (torch's SDPA over gathered
# blocks where that wins: kernels/cpu/native_attention.py), and RMSNorm, rotary and SiLU-and-multiply
# fused into one pass each (kernels/cpu/native_elementwise.py). Each falls back to torch for what it
# does not take.
TORCH_KERNELS = Kernels(
    name="torch",
    rms_norm=native_elementwise.rms_norm,
    silu_and_mul=native_elementwise.silu_and_mul,
    apply_rotary=native_elementwise.apply_rotary,
    write_kv=kv_write.write_kv,
    paged_attention=cpu_paged_attention.paged_attention,
    rotary_store_kv=native_elementwise.rotary_store_kv,
    gelu_tanh_and_mul=native_elementwise.gelu_tanh_and_mul,
)


# The same with attention's products in bf16 on a bf16 KV cache (``attention_dtype="bfloat16"``:
# native_attention.PRODUCTS): queries and softmax weights rounded to bf16.
TORCH_KERNELS_BF16_PRODUCTS = dataclasses.replace(
    TORCH_KERNELS,
    name="torch, bf16 attention products",
    paged_attention=cpu_paged_attention.paged_attention_bf16_products,
)


def triton_kernels() -> Kernels:
    from kernels.triton import registry  # imported lazily: triton is heavy and CUDA-oriented

    return registry.TRITON_KERNELS


def select_kernels(
    device: torch.device | str, backend: str | None = None, attention_dtype: str | None = None
) -> Kernels:
    """Triton on CUDA, torch elsewhere; ``backend`` ("torch", "triton", or "reference": the twins
    as written, for comparisons) overrides the choice. ``attention_dtype`` "bfloat16": the torch
    bundle with bf16 attention products (the CPU's native kernel; a ValueError naming why where it
    cannot run)."""
    device = torch.device(device)
    if backend is None or backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS} or 'auto', got {backend!r}")
    if attention_dtype == "bfloat16":
        if device.type != "cpu" or backend != "torch":
            raise ValueError(
                "attention_dtype='bfloat16' runs on the CPU's native attention kernel: device 'cpu' and "
                f"kernel_backend 'torch' or 'auto', got device {device.type!r}, kernel_backend {backend!r}"
            )
        cpu_paged_attention.check_bf16_products()
        log.info(
            "kernels: torch on cpu, paged attention native with bf16 products (%s)",
            cpu_paged_attention.build_name(torch.bfloat16, "bfloat16"),
        )
        return TORCH_KERNELS_BF16_PRODUCTS
    if backend == "triton":
        kernels = triton_kernels()
    else:
        kernels = REFERENCE_KERNELS if backend == "reference" else TORCH_KERNELS
    if kernels is TORCH_KERNELS and device.type == "cpu":
        log.info(
            "kernels: torch on cpu, paged attention %s, rms_norm and rotary %s",
            cpu_paged_attention.prepare(),
            native_elementwise.prepare(),
        )
        return kernels
    log.info("kernels: %s on %s", kernels.name, device)
    return kernels
