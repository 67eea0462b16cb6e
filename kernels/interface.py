"""What the engine calls: one kernel per operation, bundled per implementation. A module of its own
so that the implementations (``kernels/backend.py``'s torch and reference bundles, and
``kernels/triton/registry.py``) import it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels.reference import activation, kv_write, lora


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable
    silu_and_mul: Callable
    apply_rotary: Callable
    write_kv: Callable
    paged_attention: Callable
    lora_apply: Callable = lora.lora_apply  # batched mixed-adapter LoRA (kernels/reference/lora.py)
    # Rotary and the cache write in one call on the fused QKV rows (kernels/reference/kv_write.py);
    # a bundle without one composes its own apply_rotary and write_kv (``rotate_and_store``).
    rotary_store_kv: Callable | None = None
    # GELU(tanh)-and-multiply on a fused [gate | up] (Gemma's MLP): torch's, on every bundle.
    gelu_tanh_and_mul: Callable = activation.gelu_tanh_and_mul

    def rotate_and_store(
        self, qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
    ):
        """The rotated queries ``[T, Hq, D]``; the rotated keys and the values stored in the caches."""
        if self.rotary_store_kv is not None:
            return self.rotary_store_kv(
                qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
            )
        return kv_write.rotary_store_kv(
            qkv,
            positions,
            cos_sin,
            k_cache,
            v_cache,
            slot_mapping,
            num_heads,
            num_kv_heads,
            apply_rotary=self.apply_rotary,
            write_kv=self.write_kv,
        )
