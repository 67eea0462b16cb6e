"""RMSNorm (+ residual), rotary embedding and SiLU-and-multiply through the fused native kernels
(``kernels/cpu/native/elementwise.c``): one pass over memory where the torch twins make one per
operation (measured with ``python -m benchmarks.cpu_kernels``). Each takes what the reference
takes and returns what it returns; anything but fp32 on the CPU in the layouts below (or
``LLMSERVE_NATIVE_ELEMENTWISE=0``, or no C compiler) runs the reference (``kernels/reference``).
SiLU-and-multiply runs native on the instruction sets in ``NATIVE_SILU`` (a caller naming ``isa``
gets that build).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels.cpu import isa_choice, native_build
from kernels.cpu.checked_once import CheckedOnce
from kernels.cpu.isa_choice import chosen_isa_in
from kernels.reference import activation, kv_write, rmsnorm, rotary

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_SIGNATURES = {
    "llmserve_rms_norm_f32": [_P, _P, _P, _F32, _I64, _I64, _P, _P, _I32],
    "llmserve_rotary_f32": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I32],
    "llmserve_silu_and_mul_f32": [_P, _I64, _I64, _P, _I32],
    "llmserve_gelu_tanh_and_mul_f32": [_P, _I64, _I64, _P, _I32],
    "llmserve_rotary_store_kv_f32": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I32],
    "llmserve_rotary_store_kv_bf16": [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I32],
}
# The caches' dtypes the fused rotary-and-store writes (a bf16 cache: each value rounded to
# nearest even, as torch's copy into it), and its entry for each.
STORE_ENTRIES = {
    torch.float32: "llmserve_rotary_store_kv_f32",
    torch.bfloat16: "llmserve_rotary_store_kv_bf16",
}
# Where the fused SiLU-and-multiply runs native. Against torch's two vectorized passes
# (benchmarks/cpu_kernels.py): 1.2-1.9x with AVX-512; with AVX2 0.8-1.0x on the machine first
# measured and 1.1-1.5x on an Intel Xeon (1 to 512 rows of 1536) later. AVX2 is in regardless: the
# native layer loop (native_decoder.py) calls every kernel of a layer from C, so where SiLU is not
# native the loop is off, and at batch 1 the loop is worth about 2x (the Xeon's AVX2 build, two
# threads: 115-129 tok/s without it against a microsecond a layer for SiLU). The generic build does
# not vectorize its exp (5-8x slower than torch's): it keeps torch's.
NATIVE_SILU = ("avx512", "avx2")


def enabled() -> bool:
    return os.environ.get("LLMSERVE_NATIVE_ELEMENTWISE", "1") != "0"


def library(isa: str | None = None):
    """The build for ``isa`` (default: the chosen set, asked on each call), or None."""
    return _library(isa or isa_choice.chosen())


@functools.cache
def _library(isa: str):
    lib = native_build.load_or_none("elementwise", isa)
    if lib is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return lib


def _lib(*tensors: torch.Tensor, isa: str | None = None):
    # Written for speed: at batch 1 these wrappers run 150 times a token around kernels of a
    # microsecond or two (``is_cpu`` is a flag; ``device.type`` builds a device object).
    if not enabled():
        return None
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return None
    return library(isa)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *, isa=None
) -> tuple[torch.Tensor, torch.Tensor]:
    parts = (x, weight) if residual is None else (x, weight, residual)
    lib = _lib(*parts, isa=isa)
    if (
        lib is None
        or not (x.is_contiguous() and weight.is_contiguous())
        or (residual is not None and not (residual.is_contiguous() and residual.shape == x.shape))
    ):
        return rmsnorm.rms_norm(x, weight, eps, residual)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    out = torch.empty_like(x)
    if residual is None:
        threads = torch.get_num_threads()
        lib.llmserve_rms_norm_f32(
            x.data_ptr(), None, weight.data_ptr(), eps, rows, dim, out.data_ptr(), None, threads
        )
        return out, x
    res_out = torch.empty_like(x)
    lib.llmserve_rms_norm_f32(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        eps,
        rows,
        dim,
        out.data_ptr(),
        res_out.data_ptr(),
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


# The step's positions and slots already checked against the tables (every layer passes the same).
_store_checked = CheckedOnce()


def rotary_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    isa=None,
) -> torch.Tensor:
    """``kernels.reference.kv_write.rotary_store_kv`` in one native pass: a layer's rotary and
    cache write, where the composition costs eight torch ops and their temporaries (at batch 1 a
    few microseconds of work under some 40 of dispatch). fp32 or bf16 caches (``STORE_ENTRIES``)."""
    lib = _lib(qkv, cos_sin_cache, isa=isa)
    cache_shape = k_cache.shape
    d = cache_shape[-1]
    t, width = qkv.shape if qkv.dim() == 2 else (0, -1)
    entry = STORE_ENTRIES.get(k_cache.dtype)
    ok = (
        lib is not None
        and entry is not None
        and v_cache.dtype is k_cache.dtype
        and k_cache.is_cpu
        and d <= 512
        and width == (num_heads + 2 * num_kv_heads) * d
        and qkv.stride(1) == 1
        and d % 2 == 0
        and cache_shape[-2] == num_kv_heads
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.shape == cache_shape
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] == d
        and positions.dtype is torch.int64
        and slot_mapping.dtype is torch.int64
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
        and positions.shape == slot_mapping.shape == (t,)
    )
    if not ok:
        return kv_write.rotary_store_kv(
            qkv,
            positions,
            cos_sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            num_heads,
            num_kv_heads,
            apply_rotary=functools.partial(apply_rotary, isa=isa),
        )
    capacity = k_cache.numel() // (num_kv_heads * d)  # slots
    bounds = (cos_sin_cache.shape[0], capacity)
    if t and not _store_checked.seen(positions, slot_mapping, bounds=bounds):
        # The kernel indexes both tables unchecked: a bad entry is an error here, not a crash.
        lo, hi = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise IndexError(f"rotary position {lo if lo < 0 else hi} outside [0, {cos_sin_cache.shape[0]})")
        if int(slot_mapping.max()) >= capacity:
            raise IndexError(f"cache slot {int(slot_mapping.max())} outside the cache's {capacity} slots")
        _store_checked.remember(positions, slot_mapping, bounds=bounds)
    q = torch.empty((t, num_heads, d), dtype=torch.float32)
    getattr(lib, entry)(
        qkv.data_ptr(),
        qkv.stride(0),
        t,
        num_heads,
        num_kv_heads,
        d,
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        slot_mapping.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        torch.get_num_threads(),
    )
    return q


def silu_and_mul(x: torch.Tensor, *, isa=None) -> torch.Tensor:
    return _gated(x, isa, "llmserve_silu_and_mul_f32", activation.silu_and_mul)


def gelu_tanh_and_mul(x: torch.Tensor, *, isa=None) -> torch.Tensor:
    """Gemma's GELU(tanh)-and-multiply; where native, its tanh is the kernel's (from the fast exp),
    within a few ulp of torch's."""
    return _gated(x, isa, "llmserve_gelu_tanh_and_mul_f32", activation.gelu_tanh_and_mul)


def _gated(x: torch.Tensor, isa, name: str, reference):
    lib = _lib(x, isa=isa)
    if (
        lib is None
        or (isa is None and not chosen_isa_in(NATIVE_SILU))
        or not x.is_contiguous()
        or x.shape[-1] % 2
    ):
        return reference(x)
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    rows = out.numel() // d if d else 0
    getattr(lib, name)(x.data_ptr(), rows, d, out.data_ptr(), torch.get_num_threads())
    return out


def prepare() -> str:
    if not enabled():
        return "reference (LLMSERVE_NATIVE_ELEMENTWISE=0)"
    if library() is None:
        return "reference (no native build)"
    isa = native_build.chosen_isa()
    silu = "native" if isa in NATIVE_SILU else "torch (native measured slower)"
    return f"native ({isa}), silu_and_mul {silu}"
