"""What this CPU and this torch build can do, asked at run time (machines differ: a CI machine may
have AVX-512 or only AVX2, with or without BF16 instructions)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_features() -> dict[str, bool | str]:
    """``capability`` is torch's vector ISA (``"AVX512"``, ``"AVX2"``, ...); the booleans say whether
    oneDNN is usable and which bf16 instructions the CPU has."""
    cpu = torch.cpu
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "onednn": _onednn_ops_available(),
        "avx512": _ask(getattr(cpu, "_is_avx512_supported", None)),
        "avx512_bf16": _ask(getattr(cpu, "_is_avx512_bf16_supported", None)),
        "amx": _ask(getattr(cpu, "_is_amx_tile_supported", None)),
        "onednn_bf16": _ask(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)),
    }


def native_bf16() -> bool:
    """bf16 matmuls run on bf16 instructions (AVX-512 BF16 or AMX) rather than being emulated."""
    f = cpu_features()
    return bool(f["onednn_bf16"] and (f["avx512_bf16"] or f["amx"]))


def _onednn_ops_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def _ask(probe) -> bool:
    if probe is None:
        return False
    try:
        return bool(probe())
    except Exception:  # an op missing from this build is the same answer as "no"
        return False
