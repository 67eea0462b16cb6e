"""The model's linears through the native GEMM (``kernels/cpu/native/small_gemm.c``): the weight
is packed once into column panels, and each output is one chain of multiply-adds over K in order,
so a row's result is the same bit for bit whatever else is in the batch. The weight is kept as fp32,
or as bf16 or fp16 (a bf16/fp16 checkpoint at ``dtype="auto"``: half the bytes to stream, widened to
fp32 in registers, exactly, so the result is bit-equal to the fp32 GEMM on the widened values);
activations and outputs are fp32.

Measured (``python -m benchmarks.cpu_kernels``, weights streamed from memory as in a real step) it
beats oneDNN's prepacked GEMM at decode sizes (M = 1..64) and matches it on prefills, on AVX-512
and AVX2 (``FASTER_THAN_ONEDNN``); the generic build (SSE2, no FMA) is a fraction of it and runs
only when asked for by name (``linear_backend="native"``).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from kernels.cpu import native_build

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "llmserve_gemm_pack_f32": ([_P, _I64, _I64, _P], None),
    "llmserve_gemm_f32": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], None),
    "llmserve_gemm_pack_bf16": ([_P, _I64, _I64, _P], None),
    "llmserve_gemm_bf16w": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], None),
    "llmserve_gemm_f16w": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], None),
    "llmserve_gemm_panel_width": ([], _I32),
}
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The 16-bit weights' GEMM entry (their packing only moves bits: one function packs both).
_HALF_GEMM = {torch.bfloat16: "llmserve_gemm_bf16w", torch.float16: "llmserve_gemm_f16w"}
FASTER_THAN_ONEDNN = ("avx512", "avx2")


def library(isa: str | None = None):
    """The build for ``isa`` (default: the chosen set), or None where none builds."""
    return _library(isa or native_build.chosen_isa())


@functools.cache
def _library(isa: str):
    return native_build.load_with_signatures("small_gemm", isa, _SIGNATURES)


def unusable_reason(dtype: torch.dtype, *, forced: bool = False) -> str | None:
    """Why the native GEMM would not serve ``dtype`` here (None: it would). ``forced``: asked for by
    name, so a build slower than oneDNN still serves."""
    if dtype not in WEIGHT_DTYPES:
        return f"{dtype} (the native GEMM keeps fp32, bf16 or fp16 weights)"
    if library() is None:
        return "no native build (see the log)"
    isa = native_build.chosen_isa()
    if not forced and isa not in FASTER_THAN_ONEDNN:
        return f"the {isa} build measured slower than oneDNN"
    return None


class NativeLinear:
    """``F.linear(x, weight, bias)`` on the CPU in fp32, on a weight packed at construction: as fp32,
    or as bf16 / fp16 when ``weight`` is (or ``weight_dtype`` says: the weight rounded to it first).
    The output is fp32 either way."""

    kind = "native"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        isa: str | None = None,
        weight_dtype: torch.dtype | None = None,
    ):
        lib = library(isa)
        if lib is None:
            raise RuntimeError("the native GEMM has no build here")
        self.weight_dtype = weight_dtype or weight.dtype
        if self.weight_dtype not in WEIGHT_DTYPES or weight.dim() != 2:
            raise ValueError(
                "the native GEMM takes a 2-D fp32, bf16 or fp16 weight, "
                f"got {self.weight_dtype} {tuple(weight.shape)}"
            )
        w = weight.detach().to(self.weight_dtype).contiguous()
        self.out_features, self.in_features = w.shape
        nb = lib.llmserve_gemm_panel_width()
        size = -(-self.out_features // nb) * nb * self.in_features
        self.packed = torch.empty(size, dtype=self.weight_dtype)
        fp32 = self.weight_dtype == torch.float32
        pack = lib.llmserve_gemm_pack_f32 if fp32 else lib.llmserve_gemm_pack_bf16
        pack(w.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._gemm = lib.llmserve_gemm_f32 if fp32 else getattr(lib, _HALF_GEMM[self.weight_dtype])
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def native_entry(self) -> NativeEntry:
        return NativeEntry(
            fn_address(self._gemm),
            None,
            self._packed_ptr,
            self._bias_ptr,
            self.out_features,
            self.in_features,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2, y = rows_in_and_out(x, self.in_features, self.out_features)
        m = x2.shape[0]
        if m:
            self._gemm(
                x2.data_ptr(),
                m,
                self.in_features,
                x2.stride(0),
                self._packed_ptr,
                self.out_features,
                self._bias_ptr,
                y.data_ptr(),
                self.out_features,
                torch.get_num_threads(),
            )
        return y.view(*lead, self.out_features)


class NativeEntry(NamedTuple):
    """How native code runs a linear itself (``kernels/cpu/native_decoder.py``), with the arguments
    its ``__call__`` passes: the GEMM's entry point, the weight's format code (None: the entry
    takes none, small_gemm.c's; else quant_gemm.c's or quant_int8act.c's, which return nonzero to
    refuse), the packed weight, the bias (None: none), and the output and input widths. The
    pointers stay valid while the linear lives."""

    fn: int
    code: int | None
    packed: int
    bias: int | None
    out_features: int
    in_features: int


def fn_address(fn) -> int:
    """The address of a ctypes library function (for native code to call it directly)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def rows_in_and_out(x: torch.Tensor, in_features: int, out_features: int):
    """A native linear's operands: the leading shape, the input as unit-stride fp32 rows, and the
    fresh output rows (every native linear takes and gives these)."""
    if x.shape[-1] != in_features:
        raise ValueError(f"linear takes rows of {in_features}, got {tuple(x.shape)}")
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1 or x2.dtype != torch.float32:
        x2 = x2.float().contiguous()
    return x.shape[:-1], x2, torch.empty(x2.shape[0], out_features, dtype=torch.float32)
