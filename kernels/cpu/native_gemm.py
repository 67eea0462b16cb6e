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

import numpy as np
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
    # bf16 products (linear_dtype="bfloat16"): the weight as pairs, the activations rounded to bf16
    "llmserve_gemm_bf16_pairs_size": ([_I64, _I64], _I64),
    "llmserve_gemm_pack_bf16_pairs": ([_P, _I64, _I64, _P], None),
    "llmserve_gemm_bf16_dot": ([_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], _I32),
    "llmserve_gemm_bf16_dot_native": ([_I32], _I32),
}
PRODUCTS = ("float32", "bfloat16")
# The AMX-BF16 path (AVX-512 builds on Linux only: absent from the others).
_AMX_SIGNATURES = {
    "llmserve_gemm_bf16_amx": ([_I32], _I32),
    "llmserve_gemm_bf16_amx_size": ([_I64, _I64], _I64),
    "llmserve_gemm_bf16_amx_panel_width": ([], _I32),
    "llmserve_gemm_pack_bf16_amx": ([_P, _I64, _I64, _P], None),
    "llmserve_gemm_bf16w_amx": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], None),
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
    lib = native_build.load_with_signatures("small_gemm", isa, _SIGNATURES)
    if lib is not None and hasattr(lib, "llmserve_gemm_bf16_amx"):
        for name, (args, res) in _AMX_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
    return lib


def bf16_amx(isa: str | None = None, on: bool | None = None) -> bool:
    """Whether bf16 weights packed from now on run on the AMX-BF16 tiles (exact-split activations):
    the build has the path and the OS granted the tiles (small_gemm.c's probe). ``on``: False turns
    the path off (tests: the FMA path on this machine), True back on (where granted)."""
    lib = library(isa)
    if lib is None or not hasattr(lib, "llmserve_gemm_bf16_amx"):
        return False
    return bool(lib.llmserve_gemm_bf16_amx(-1 if on is None else int(on)))


def bf16_path(isa: str | None = None) -> str:
    """Which kernel a bf16 weight runs on here, in words (the load log's)."""
    isa = isa or native_build.chosen_isa()
    if bf16_amx(isa):
        return "AMX-BF16 tiles, exact 3-part split activations"
    return {"avx512": "AVX-512 FMA", "avx2": "AVX2 FMA"}.get(isa, f"{isa} FMA")


def bf16_dot_native(isa: str | None = None, on: bool | None = None) -> bool:
    """Whether bf16-product GEMMs (``products="bfloat16"``) run on the CPU's VDPBF16PS (AVX512-BF16,
    the avx512 build), rather than its order in fused multiply-adds: the same bits either way.
    ``on``: False the FMA order (tests), True back to the instruction where the CPU has it."""
    lib = library(isa)
    return lib is not None and bool(lib.llmserve_gemm_bf16_dot_native(-1 if on is None else int(on)))


def bf16_dot_path(isa: str | None = None) -> str:
    """Which kernel bf16 products run on here, in words (the load log's)."""
    return "VDPBF16PS" if bf16_dot_native(isa) else "VDPBF16PS's order in fused multiply-adds"


def bf16_products_reference(x: np.ndarray, w: torch.Tensor, bias: torch.Tensor | None = None) -> np.ndarray:
    """small_gemm.c's bf16 products stated in numpy: x [m, k] fp32 rounded to bf16 (nearest, ties to
    even), w [n, k] bf16; per pair p in order, acc += x[2p+1] w[2p+1] then acc += x[2p] w[2p], each an
    fp32 addition of an exact product, denormal operands and results flushed to zero; then + bias."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    xb = torch.from_numpy(x).to(torch.bfloat16).float().numpy()  # torch rounds to nearest even
    wf = w.float().numpy()
    tiny = np.float32(np.finfo(np.float32).tiny)

    def flush(a: np.ndarray) -> np.ndarray:
        return np.where(np.abs(a) < tiny, np.float32(0), a).astype(np.float32)

    xb, wf = flush(xb), flush(wf)
    acc = np.zeros((m, wf.shape[0]), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for p in range((k + 1) // 2):
            for j in (2 * p + 1, 2 * p):
                if j < k:
                    acc = flush(acc + xb[:, j : j + 1] * wf[None, :, j])
        if bias is not None:
            acc = acc + bias.float().numpy()[None, :]
    return acc


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
    The output is fp32 either way. The packed weight is panels of ``panel`` columns one after
    another, ``panel_elems`` elements each, and an output is its own row and column's math whatever
    the call's width: ``columns`` runs a slice of panels (kernels/cpu/greedy_head.py)."""

    kind = "native"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        isa: str | None = None,
        weight_dtype: torch.dtype | None = None,
        products: str = "float32",
    ):
        lib = library(isa)
        if lib is None:
            raise RuntimeError("the native GEMM has no build here")
        self.weight_dtype = weight_dtype or weight.dtype
        if products not in PRODUCTS:
            raise ValueError(f"products must be one of {PRODUCTS}, got {products!r}")
        if products == "bfloat16" and self.weight_dtype != torch.bfloat16:
            raise ValueError(f"bf16 products take a bf16 weight, got {self.weight_dtype}")
        self.products = products
        if self.weight_dtype not in WEIGHT_DTYPES or weight.dim() != 2:
            raise ValueError(
                "the native GEMM takes a 2-D fp32, bf16 or fp16 weight, "
                f"got {self.weight_dtype} {tuple(weight.shape)}"
            )
        w = weight.detach().to(self.weight_dtype).contiguous()
        self.out_features, self.in_features = w.shape
        fp32 = self.weight_dtype == torch.float32
        # bf16 on AMX-BF16 where granted: the tiles' packing only (no FMA panels held beside it)
        self.amx = self.weight_dtype == torch.bfloat16 and products == "float32" and bf16_amx(isa)
        self._coded = products == "bfloat16"  # the entry takes a code first and returns nonzero to refuse
        if self._coded:
            nb = lib.llmserve_gemm_panel_width()
            size = lib.llmserve_gemm_bf16_pairs_size(self.out_features, self.in_features)
            pack, self._gemm = lib.llmserve_gemm_pack_bf16_pairs, lib.llmserve_gemm_bf16_dot
            self.panel = int(nb)
            self.panel_elems = lib.llmserve_gemm_bf16_pairs_size(nb, self.in_features)
        elif self.amx:
            size = lib.llmserve_gemm_bf16_amx_size(self.out_features, self.in_features)
            pack, self._gemm = lib.llmserve_gemm_pack_bf16_amx, lib.llmserve_gemm_bf16w_amx
            self.panel = int(lib.llmserve_gemm_bf16_amx_panel_width())
            self.panel_elems = lib.llmserve_gemm_bf16_amx_size(self.panel, self.in_features)
        else:
            nb = lib.llmserve_gemm_panel_width()
            size = -(-self.out_features // nb) * nb * self.in_features
            self.panel, self.panel_elems = int(nb), int(nb) * self.in_features
            pack = lib.llmserve_gemm_pack_f32 if fp32 else lib.llmserve_gemm_pack_bf16
            self._gemm = lib.llmserve_gemm_f32 if fp32 else getattr(lib, _HALF_GEMM[self.weight_dtype])
        self.packed = torch.empty(size, dtype=self.weight_dtype)
        pack(w.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def _run(self, x_ptr: int, m: int, ldx: int, packed: int, n: int, bias, y_ptr: int, ldy: int) -> None:
        args = (x_ptr, m, self.in_features, ldx, packed, n, bias, y_ptr, ldy, torch.get_num_threads())
        if not self._coded:
            self._gemm(*args)
            return
        rc = self._gemm(0, *args)
        if rc:
            raise MemoryError(f"the bf16-product GEMM could not allocate its activations' buffer (rc {rc})")

    def native_entry(self) -> NativeEntry:
        return NativeEntry(
            fn_address(self._gemm),
            0 if self._coded else None,
            self._packed_ptr,
            self._bias_ptr,
            self.out_features,
            self.in_features,
        )

    def columns(self, x: torch.Tensor, c0: int, width: int, y: torch.Tensor) -> None:
        """Output columns [c0, c0 + width) of ``self(x)`` into ``y`` (rows ``width`` apart, fp32):
        x [rows, in] unit-stride fp32, c0 a multiple of ``panel``."""
        if c0 % self.panel or c0 < 0 or width <= 0 or c0 + width > self.out_features:
            raise ValueError(f"columns [{c0}, {c0 + width}) of {self.out_features} by panels of {self.panel}")
        if x.dim() != 2 or x.shape[1] != self.in_features or x.stride(-1) != 1 or x.dtype != torch.float32:
            raise ValueError(
                f"columns takes unit-stride fp32 rows of {self.in_features}, got {tuple(x.shape)}"
            )
        if y.dtype != torch.float32 or y.numel() < x.shape[0] * width:
            raise ValueError("columns writes fp32 rows of width into y")
        offset = c0 // self.panel * self.panel_elems * self.packed.element_size()
        bias = None if self.bias is None else self.bias[c0 : c0 + width].data_ptr()
        self._run(
            x.data_ptr(), x.shape[0], x.stride(0), self._packed_ptr + offset, width, bias, y.data_ptr(), width
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2, y = rows_in_and_out(x, self.in_features, self.out_features)
        m = x2.shape[0]
        if m:
            self._run(
                x2.data_ptr(), m, x2.stride(0), self._packed_ptr, self.out_features, self._bias_ptr,
                y.data_ptr(), self.out_features,
            )  # fmt: skip
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


FLT_MIN = np.float32(2.0**-126)


def _ftz(v: np.ndarray) -> np.ndarray:
    """Subnormal fp32 results flushed to (signed) zero, as the tiles do."""
    return np.where(np.abs(v) < FLT_MIN, np.copysign(np.float32(0), v), v).astype(np.float32)


def bf16_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp32 x as three bf16 parts by truncation (each as fp32 values), x = x1 + x2 + x3 exactly
    where no part is below 2^-126; a part below it is zero (the tiles read subnormal bf16 as zero);
    a non-finite x is x1, with parts 2 and 3 zero. small_gemm.c's split."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    mask = np.uint32(0xFFFF0000)

    def trunc(v):
        b = v.view(np.uint32) & mask
        b = np.where(b & np.uint32(0x7F800000), b, np.uint32(0))  # DAZ: a subnormal part is 0
        return b.view(np.float32)

    finite = np.isfinite(x)
    x1 = trunc(x)
    with np.errstate(invalid="ignore"):
        r = np.where(finite, x - x1, np.float32(0)).astype(np.float32)
    x2 = trunc(r)
    x3 = trunc((r - x2).astype(np.float32))
    return x1, x2, x3


def amx_bf16_reference(
    x: np.ndarray, w_bits: np.ndarray, bias: np.ndarray | None = None, *, parts_order=(0, 1, 2), paired=False
) -> np.ndarray:
    """The AMX-BF16 path's math in numpy (small_gemm.c's comment), bit for bit: x (m x k) fp32,
    w_bits (n x k) the weight's bf16 bit patterns (uint16). Each part x1, x2, x3 has its own fp32
    sum C1, C2, C3 (rows of one C tile) from zero over the k tiles of 32: per tile the even and the
    odd elements of the 16 pairs as two chains of fused multiply-adds from zero (RNE, FTZ; a product
    of two bf16 is exact, the fma then one rounding, done here in float64: correctly rounded to
    fp32, binary64 having over 2 x 24 + 2 bits), then Cp = Cp + (E + O) (RNE, FTZ); at the end
    y = (C1 + (C2 + C3)) + bias in plain fp32. ``parts_order`` and ``paired`` (the SDM's older
    order: both elements of a pair added to C in turn) state wrong math, for the tests to show it
    differs."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    n = w_bits.shape[0]
    w = (np.asarray(w_bits, dtype=np.uint32) << 16).view(np.float32)
    w = np.where(np.abs(w) < FLT_MIN, np.float32(0), w).astype(np.float32)  # DAZ
    kt = -(-k // 32)
    pad = kt * 32 - k
    split = bf16_split(x)
    parts = [np.pad(split[i], ((0, 0), (0, pad))).astype(np.float64) for i in parts_order]
    w64 = np.pad(w, ((0, 0), (0, pad))).astype(np.float64)
    acc = [np.zeros((m, n), dtype=np.float32) for _ in parts]
    for t in range(kt):
        for c, p in zip(acc, parts, strict=True):
            if paired:
                for kk in range(32 * t, 32 * t + 32):
                    c[:] = _ftz((c.astype(np.float64) + np.outer(p[:, kk], w64[:, kk])).astype(np.float32))
                continue
            chains = []
            for e in (0, 1):
                ch = np.zeros((m, n), dtype=np.float32)
                for j in range(16):
                    kk = 32 * t + 2 * j + e
                    ch = _ftz((ch.astype(np.float64) + np.outer(p[:, kk], w64[:, kk])).astype(np.float32))
                chains.append(ch)
            c[:] = _ftz((c + _ftz((chains[0] + chains[1]).astype(np.float32))).astype(np.float32))
    c = acc[0]
    if len(acc) > 1:
        rest = acc[1] if len(acc) == 2 else (acc[1] + acc[2]).astype(np.float32)
        c = (c + rest).astype(np.float32)
    if bias is not None:
        c = (c + np.asarray(bias, dtype=np.float32)).astype(np.float32)
    return c
