"""RMSNorm (+ residual), rotary embedding and SiLU-and-multiply through the fused native kernels
(``kernels/cpu/native/elementwise.c``): one pass over memory where the torch twins make one per
operation (measured with ``python -m benchmarks.cpu_kernels``). Each takes what the reference
takes and returns what it returns; anything but fp32 on the CPU in the layouts below (or
``LLMSERVE_NATIVE_ELEMENTWISE=0``, or no C compiler) runs the reference (``kernels/reference``).
SiLU-and-multiply runs native only where it measured faster than torch's (``SILU_FASTER_THAN_TORCH``;
a caller naming ``isa`` gets that build).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels.cpu import native_build
from kernels.reference import activation, rmsnorm, rotary

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_SIGNATURES = {
    "llmserve_rms_norm_f32": [_P, _P, _P, _F32, _I64, _I64, _P, _P, _I32],
    "llmserve_rotary_f32": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I32],
    "llmserve_silu_and_mul_f32": [_P, _I64, _I64, _P, _I32],
}
# Where the fused SiLU-and-multiply measured faster than torch's two vectorized passes
# (benchmarks/cpu_kernels.py): 1.2-1.9x with AVX-512; 0.8-1.0x with AVX2 (its 8-lane divide), and
# the generic build does not vectorize its exp.
SILU_FASTER_THAN_TORCH = ("avx512",)


def enabled() -> bool:
    return os.environ.get("LLMSERVE_NATIVE_ELEMENTWISE", "1") != "0"


@functools.cache
def library(isa: str | None = None):
    lib = native_build.load_or_none("elementwise", isa)
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return lib


def _lib(*tensors: torch.Tensor, isa: str | None = None):
    if not enabled() or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return library(isa)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *, isa=None
) -> tuple[torch.Tensor, torch.Tensor]:
    parts = (x, weight) if residual is None else (x, weight, residual)
    lib = _lib(*parts, isa=isa)
    if (
        lib is None
        or not all(t.is_contiguous() for t in parts)
        or (residual is not None and residual.shape != x.shape)
    ):
        return rmsnorm.rms_norm(x, weight, eps, residual)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    lib.llmserve_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        eps,
        rows,
        dim,
        out.data_ptr(),
        res_out.data_ptr() if residual is not None else None,
        torch.get_num_threads(),
    )
    return out, res_out


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, *, isa=None
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _lib(q, k, cos_sin_cache, isa=isa)
    ok = (
        lib is not None
        and q.dim() == 3
        and k.dim() == 3
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and q.shape[-1] % 2 == 0
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] == q.shape[-1]
    )
    if not ok:
        return rotary.apply_rotary(positions, q, k, cos_sin_cache)
    pos = (
        positions
        if positions.dtype == torch.int64 and positions.is_contiguous()
        else positions.long().contiguous()
    )
    if pos.numel():  # the kernel indexes the table unchecked: a bad position is an error here, not a crash
        lo, hi = (int(v) for v in torch.aminmax(pos))
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise IndexError(f"rotary position {lo if lo < 0 else hi} outside [0, {cos_sin_cache.shape[0]})")
    outs = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=x.dtype)
        lib.llmserve_rotary_f32(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            x.shape[0],
            x.shape[1],
            x.shape[2],
            pos.data_ptr(),
            cos_sin_cache.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        outs.append(out)
    return outs[0], outs[1]


def silu_and_mul(x: torch.Tensor, *, isa=None) -> torch.Tensor:
    lib = _lib(x, isa=isa)
    if (
        lib is None
        or (isa is None and native_build.chosen_isa() not in SILU_FASTER_THAN_TORCH)
        or not x.is_contiguous()
        or x.shape[-1] % 2
    ):
        return activation.silu_and_mul(x)
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    rows = out.numel() // d if d else 0
    lib.llmserve_silu_and_mul_f32(x.data_ptr(), rows, d, out.data_ptr(), torch.get_num_threads())
    return out


def prepare() -> str:
    if not enabled():
        return "reference (LLMSERVE_NATIVE_ELEMENTWISE=0)"
    if library() is None:
        return "reference (no native build)"
    isa = native_build.chosen_isa()
    silu = "native" if isa in SILU_FASTER_THAN_TORCH else "torch (native measured slower)"
    return f"native ({isa}), silu_and_mul {silu}"
