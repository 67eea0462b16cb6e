"""What the engine calls: one kernel per operation, bundled per implementation. A module of its own
so that the implementations (``kernels/backend.py``'s torch and reference bundles, and
``kernels/triton/registry.py``) import it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels.reference import lora


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable
    silu_and_mul: Callable
    apply_rotary: Callable
    write_kv: Callable
    paged_attention: Callable
    lora_apply: Callable = lora.lora_apply  # batched mixed-adapter LoRA (kernels/reference/lora.py)
