"""Linears on quantized weights (``kernels/cpu/native/quant_gemm.c``): 32-weight blocks of Q8_0,
Q4_0 or Q4_1, as a GGUF file stores them or as made at load from a float checkpoint
(``quantize_rows``), repacked once into the kernel's panels and dequantized in registers.

A ``QuantizedWeight`` is the format-neutral form the loader builds: one byte per quant (``q``,
``[n, k]``), fp32 scales ``d`` and (Q4_1) minimums ``m`` per row and block (``[n, k / 32]``). Rows
of several tensors concatenate (the fused q/k/v and gate/up projections) and permute (the GGUF
q/k row order) in that form before packing.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu import native_build
from kernels.cpu.native_gemm import rows_in_and_out

FORMATS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
QK = 32
# GGUF block layouts (bytes): Q8_0 = f16 d + 32 int8; Q4_0 = f16 d + 16 nibble pairs; Q4_1 = f16 d,
# f16 m + 16 nibble pairs. A pair's byte t holds element t (low nibble) and t + 16 (high).
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "llmserve_qgemm_pack": ([_I32, _P, _P, _P, _I64, _I64, _P], None),
    "llmserve_qgemm_packed_bytes": ([_I32, _I64, _I64], _I64),
    "llmserve_qgemm": ([_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], _I32),
    "llmserve_qgemm_panel_width": ([], _I32),
}


def library(isa: str | None = None):
    return _library(isa or native_build.chosen_isa())


@functools.cache
def _library(isa: str):
    lib = native_build.load_or_none("quant_gemm", isa)
    if lib is None:
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def unusable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"device is {device.type}"
    if library() is None:
        return "no native build of quant_gemm (see the log)"
    return None


@dataclass
class QuantizedWeight:
    fmt: str  # Q8_0, Q4_0 or Q4_1
    q: torch.Tensor  # [n, k] uint8 (int8 bits for Q8_0; 0..15 for Q4)
    d: torch.Tensor  # [n, k / 32] fp32
    m: torch.Tensor | None  # [n, k / 32] fp32, Q4_1 only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def rows(self, index) -> QuantizedWeight:
        """Rows ``index`` (a slice or an index tensor), e.g. a permutation."""
        m = None if self.m is None else self.m[index]
        return QuantizedWeight(self.fmt, self.q[index], self.d[index], m)

    def dequantize(self) -> torch.Tensor:
        """fp32, rounded as the gguf package rounds (``d * q``, ``d * (q - 8)``, ``d * q + m``)."""
        n, k = self.shape
        q = self.q.view(torch.int8) if self.fmt == "Q8_0" else self.q
        qf = q.float().view(n, k // QK, QK)
        if self.fmt == "Q4_0":
            qf = qf - 8
        w = self.d[..., None] * qf
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(n, k)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    fmts = {p.fmt for p in parts}
    if len(fmts) != 1:
        raise ValueError(f"cannot fuse weights of different formats {sorted(fmts)}")
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return QuantizedWeight(parts[0].fmt, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)


def from_gguf_blocks(fmt: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """The GGUF tensor's raw blocks (``[n, row bytes]`` uint8) in the format-neutral form."""
    if fmt not in _BLOCK_BYTES:
        raise ValueError(f"no quantized kernel for GGUF type {fmt}")
    n, k = shape
    if k % QK:
        raise ValueError(f"rows of {k} are not whole {fmt} blocks")
    blocks = np.ascontiguousarray(raw).reshape(n, k // QK, _BLOCK_BYTES[fmt])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = None
    if fmt == "Q8_0":
        q = blocks[..., 2:].copy()
    else:
        start = 4 if fmt == "Q4_1" else 2
        if fmt == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., start:]
        q = np.concatenate([packed & 15, packed >> 4], axis=-1)
    return QuantizedWeight(
        fmt,
        torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
        torch.from_numpy(np.ascontiguousarray(d)),
        None if m is None else torch.from_numpy(np.ascontiguousarray(m)),
    )


def quantize_rows(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """A float weight ``[n, k]`` into 32-weight blocks, llama.cpp's reference rounding: Q8_0 with
    ``d = max|w| / 127`` (fp16-rounded, as a GGUF block stores it) and Q4_1 with ``d = (max - min)
    / 15``, ``m = min``. The scales are fp16-rounded so that the blocks are what a GGUF file of the
    same weights would hold."""
    n, k = w.shape
    if k % QK:
        raise ValueError(f"quantization needs rows that are a multiple of {QK}, got {k}")
    x = w.detach().float().reshape(n, k // QK, QK)
    if fmt == "Q8_0":
        amax = x.abs().amax(-1)
        d = (amax / 127).half().float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(x * inv[..., None]).clamp(-128, 127).to(torch.int8).view(torch.uint8)
        return QuantizedWeight(fmt, q.reshape(n, k).contiguous(), d.contiguous(), None)
    if fmt == "Q4_1":
        lo, hi = x.amin(-1), x.amax(-1)
        d = ((hi - lo) / 15).half().float()
        mn = lo.half().float()
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round((x - mn[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
        return QuantizedWeight(fmt, q.reshape(n, k).contiguous(), d.contiguous(), mn.contiguous())
    raise ValueError(f"quantize_rows makes Q8_0 or Q4_1, got {fmt}")


class QuantLinear:
    """``F.linear(x, W, bias)`` with ``W`` as a ``QuantizedWeight``, packed at construction."""

    kind = "quantized"

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None, *, isa: str | None = None):
        lib = library(isa)
        if lib is None:
            raise RuntimeError("the quantized GEMM has no build here")
        self.isa = isa or native_build.chosen_isa()
        self.fmt = weight.fmt
        self._code = FORMATS[weight.fmt]
        self.out_features, self.in_features = weight.shape
        q = weight.q.contiguous()
        d = weight.d.float().contiguous()
        m = None if weight.m is None else weight.m.float().contiguous()
        size = lib.llmserve_qgemm_packed_bytes(self._code, self.out_features, self.in_features)
        self.packed = torch.empty(size, dtype=torch.uint8)
        lib.llmserve_qgemm_pack(
            self._code,
            q.data_ptr(),
            d.data_ptr(),
            None if m is None else m.data_ptr(),
            self.out_features,
            self.in_features,
            self.packed.data_ptr(),
        )
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._gemm = lib.llmserve_qgemm
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2, y = rows_in_and_out(x, self.in_features, self.out_features)
        m = x2.shape[0]
        if m:
            rc = self._gemm(
                self._code,
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
            if rc != 0:
                raise RuntimeError(f"quant_gemm refused format {self.fmt} with k={self.in_features}")
        return y.view(*lead, self.out_features)
