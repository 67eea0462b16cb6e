"""The Triton kernels bundled for ``kernels.backend.select_kernels`` (which imports this lazily)."""

from __future__ import annotations

from kernels.interface import Kernels
from kernels.triton import activation, kv_write, lora, paged_attention, rmsnorm, rotary

TRITON_KERNELS = Kernels(
    name="triton",
    rms_norm=rmsnorm.rms_norm,
    silu_and_mul=activation.silu_and_mul,
    apply_rotary=rotary.apply_rotary,
    write_kv=kv_write.write_kv,
    paged_attention=paged_attention.paged_attention,
    lora_apply=lora.lora_apply,
)
