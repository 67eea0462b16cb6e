"""Linears on quantized weights (``kernels/cpu/native/quant_gemm.c``): 32-weight blocks of Q8_0,
Q4_0, Q4_1, Q5_0 or Q5_1, as a GGUF file stores them or as made at load from a float checkpoint
(``quantize_rows``), and GGUF's 256-weight K-quant super-blocks Q4_K, Q5_K and Q6_K, repacked once
into the kernel's panels and dequantized in registers.

A ``QuantizedWeight`` is the format-neutral form the loader builds: one byte per quant (``q``,
``[n, k]``), fp32 scales ``d`` and (Q4_1, Q5_1, Q4_K, Q5_K) minimums ``m`` per row and block
(``[n, k / BK]``). Rows of several tensors concatenate (the fused q/k/v and gate/up projections)
and permute (the GGUF q/k row order) in that form before packing.

A K-quant super-block's sub-block scales are products of its fp16 scale and 6-bit (Q6_K: 8-bit)
integers; the gguf package rounds each product to fp32 once, so they are made here once, at load,
and the super-block becomes plain blocks: Q4_K is Q4_1's form (32 weights, ``d * q + m`` with
``m = -dmin * min``), Q5_K the byte form U8_1 (quants 0..31), Q6_K Q8_16 (int8 quants -32..31, a
scale per 16). So the kernel's weights are the gguf dequantization bit for bit. The price: the
expanded scales and byte quants take more memory than the file's blocks (Q4_K 0.75 bytes a
weight against 0.5625, Q5_K and Q6_K 1.25 against 0.69 and 0.82).

IQ4_NL (Q4_0's blocks whose nibbles index a table of 16 int8 values) is read into the Q8_0 form,
``w = d * value``, for both kernels (1.0625 bytes a weight against the file's 0.5625). IQ4_XS (the
same table, 256-weight super-blocks with a 6-bit scale per 32) is read into the Q8_0 form too,
``d = d_super * (scale - 32)`` (exact). Q2_K (2-bit quants, a 4-bit scale and minimum per 16) is
read into U8_16 (bytes, a scale and a minimum per 16). The int8-activation kernel serves both from
their super-blocks (``sup``) at the file's size.

Q5_0 and Q5_1 (32-weight blocks of 5-bit quants, fp16 scale, Q5_1 an fp16 minimum) are read into
the same form: Q5_0's quants as int8 ``q - 16`` (-16..15, so ``w = d * q``, the Q8_0 form here),
Q5_1's as 0..31 with ``w = d * q + m`` (the U8_1 form here). The int8-activation kernel
(``quant_int8act.py``) packs them as nibbles plus a plane of fifth bits, the file's 0.69 / 0.75
bytes a weight; this fp32-activation kernel reads them as bytes (1.125 / 1.25).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu import native_build
from kernels.cpu.native_gemm import NativeEntry, fn_address, rows_in_and_out

# GGUF type -> the kernel's format (quant_gemm.c's FMT_*): the K-quants run as the block form above.
FORMATS = {
    "Q8_0": 0,
    "Q4_0": 1,
    "Q4_1": 2,
    "Q5_0": 0,
    "Q5_1": 3,
    "IQ4_NL": 0,
    "Q4_K": 2,
    "Q5_K": 3,
    "Q6_K": 4,
    "Q3_K": 4,
    "Q2_K": 5,
    "IQ4_XS": 0,
}
QK = 32  # the weights per block of the formats made at load (quantize_rows)
BLOCK_K = {f: 16 if f in ("Q6_K", "Q3_K", "Q2_K") else 32 for f in FORMATS}  # weights a scale
SIGNED = ("Q8_0", "Q5_0", "IQ4_NL", "Q6_K", "Q3_K", "IQ4_XS")  # quants stored as int8 bits
# IQ4_NL's nibble -> its int8 value (ggml's kvalues_iq4nl); the weight is d * value
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
SEGMENTS = 64  # row_segments.h's code: a fused projection of row ranges in different formats
QK_K = 256  # weights per K-quant super-block
# GGUF block layouts (bytes): Q8_0 = f16 d + 32 int8; Q4_0 = f16 d + 16 nibble pairs; Q4_1 = f16 d,
# f16 m + 16 nibble pairs. A pair's byte t holds element t (low nibble) and t + 16 (high).
# Q5_0 = f16 d, 4 bytes qh (a little-endian uint32: bit j is element j's fifth bit), 16 nibble
# pairs as Q4_0's; Q5_1 = f16 d, f16 m, then Q5_0's qh and nibbles. IQ4_NL = Q4_0's layout, a
# nibble indexing IQ4_NL_VALUES (read into the Q8_0 form: int8 values, w = d * q).
# K-quants (ggml-common.h): Q4_K = f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 nibble
# bytes; Q5_K = the same + 32 bytes of fifth bits before the nibbles; Q6_K = 128 bytes of low
# nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d. Q2_K and IQ4_XS: their readers' docstrings.
_BLOCK_BYTES = {
    "Q8_0": 34,
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "IQ4_NL": 18,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
    "Q3_K": 110,
    "Q2_K": 84,
    "IQ4_XS": 136,
}
_K_ROWS = 4096  # rows a K-quant tensor is unpacked at a time (from_gguf_blocks)
SUPER_BLOCK_FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # 256 weights a block

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
    return native_build.load_with_signatures("quant_gemm", isa, _SIGNATURES)


def unusable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"device is {device.type}"
    if library() is None:
        return "no native build of quant_gemm (see the log)"
    return None


@dataclass
class SuperScales:
    """A K-quant file's super-block scales as the file holds them, beside the fp32 products in
    ``QuantizedWeight.d`` / ``m``: so that a kernel can serve the super-blocks natively
    (``quant_int8act.py``) and make ``d * sc`` and ``-(dmin * mn)`` itself (exact products)."""

    dsup: torch.Tensor  # [n, k / 256, 2] fp16 bits (int16): d, dmin (Q6_K: dmin 0)
    sc: torch.Tensor  # [n, k / BLOCK_K] uint8: the sub-blocks' 6-bit scales (Q6_K: int8 bits, k / 16)
    mn: torch.Tensor | None  # [n, k / 32] uint8: the 6-bit mins (Q4_K, Q5_K)

    def rows(self, index) -> SuperScales:
        return SuperScales(self.dsup[index], self.sc[index], None if self.mn is None else self.mn[index])


@dataclass
class QuantizedWeight:
    fmt: str  # a key of FORMATS
    q: torch.Tensor  # [n, k] uint8 (int8 bits for Q8_0 / Q5_0 / Q6_K; 0..15 for Q4*; 0..31 for Q5_1 / Q5_K)
    d: torch.Tensor  # [n, k / BLOCK_K] fp32
    m: torch.Tensor | None  # [n, k / BLOCK_K] fp32 (Q4_1, Q5_1, Q4_K, Q5_K)
    # what the linear multiplies the blocks by: "fp32" (QuantLinear) or "int8" (quant_int8act.py)
    activations: str = "fp32"
    # a K-quant's super-block scales as read from the file (None: made otherwise)
    sup: SuperScales | None = None
    # the file's own block bytes ``[n, row bytes]`` (a view of its mapping) where a reader of rows
    # keeps them instead of this expanded form (the embedding lookup: block_embedding.py)
    raw: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def rows(self, index) -> QuantizedWeight:
        """Rows ``index`` (a slice or an index tensor), e.g. a permutation."""
        m = None if self.m is None else self.m[index]
        sup = None if self.sup is None else self.sup.rows(index)
        return QuantizedWeight(self.fmt, self.q[index], self.d[index], m, sup=sup)

    def dequantize(self) -> torch.Tensor:
        """fp32, rounded as the gguf package rounds (``d * q``, ``d * (q - 8)``, ``d * q + m``)."""
        n, k = self.shape
        bk = BLOCK_K[self.fmt]
        q = self.q.view(torch.int8) if self.fmt in SIGNED else self.q
        qf = q.float().view(n, k // bk, bk)
        if self.fmt == "Q4_0":
            qf = qf - 8
        w = self.d[..., None] * qf
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(n, k)


@dataclass
class MixedRows:
    """A fused projection whose parts are in different formats (a GGUF file may keep q and k in
    Q5_0 and v in Q8_0): row ranges in order, each one format, run as segments of one packed
    weight (``kernels/cpu/native/row_segments.h``), each by its own format's kernel."""

    parts: list[QuantizedWeight]
    activations: str = "fp32"

    @property
    def fmt(self) -> str:
        return "+".join(p.fmt for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | MixedRows:
    """The parts' rows in order: one ``QuantizedWeight`` where they share a format, else a
    ``MixedRows`` of the runs of one format."""
    runs: list[list[QuantizedWeight]] = []
    for p in parts:
        if runs and runs[-1][0].fmt == p.fmt:
            runs[-1].append(p)
        else:
            runs.append([p])
    fused = []
    for run in runs:
        m = None if run[0].m is None else torch.cat([p.m for p in run])
        q, d = torch.cat([p.q for p in run]), torch.cat([p.d for p in run])
        sup = None
        if all(p.sup is not None for p in run):
            sups = [p.sup for p in run]
            mn = None if sups[0].mn is None else torch.cat([s.mn for s in sups])
            sup = SuperScales(torch.cat([s.dsup for s in sups]), torch.cat([s.sc for s in sups]), mn)
        fused.append(QuantizedWeight(run[0].fmt, q, d, m, sup=sup))
    return fused[0] if len(fused) == 1 else MixedRows(fused)


def pack_segments(segments: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """One buffer for a ``MixedRows``' packed parts ((format code, rows, packed bytes) each), as
    row_segments.h reads it: the int64 header, then each part at a 64-byte-aligned offset."""
    if not 1 <= len(segments) <= 16:
        raise ValueError(f"a fused projection takes 1..16 segments, got {len(segments)}")
    offset = (8 * (1 + 3 * len(segments)) + 63) // 64 * 64
    header = [len(segments)]
    for code, rows, packed in segments:
        header += [code, rows, offset]
        offset += (packed.numel() + 63) // 64 * 64
    out = torch.zeros(offset, dtype=torch.uint8)
    out[: 8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    for (_, _, packed), at in zip(segments, header[3::3], strict=True):
        out[at : at + packed.numel()] = packed
    return out


def from_gguf_blocks(fmt: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """The GGUF tensor's raw blocks (``[n, row bytes]`` uint8) in the format-neutral form."""
    if fmt not in _BLOCK_BYTES:
        raise ValueError(f"no quantized kernel for GGUF type {fmt}")
    n, k = shape
    per_block = QK_K if fmt in SUPER_BLOCK_FORMATS else QK
    if k % per_block:
        raise ValueError(f"rows of {k} are not whole {fmt} blocks")
    blocks = np.ascontiguousarray(raw).reshape(n, k // per_block, _BLOCK_BYTES[fmt])
    if fmt in SUPER_BLOCK_FORMATS:
        # _K_ROWS rows at a time into the result: the unpacking's intermediates (int16 and uint8
        # arrays of every quant, several at once) then stay a range's worth, not the tensor's
        # (Qwen2.5-Coder-1.5B's Q6_K LM head: 233 M quants, ~1.5 GiB of them in the load's peak).
        q = np.empty((n, k), np.uint8)
        d = np.empty((n, k // BLOCK_K[fmt]), np.float32)
        m, sups = None, []
        for r in range(0, n, _K_ROWS):
            qr, dr, mr, sup = _K_READERS[fmt](blocks[r : r + _K_ROWS])
            rows = qr.reshape(-1, k).shape[0]
            q[r : r + rows] = qr.reshape(rows, k)
            d[r : r + rows] = dr.reshape(rows, -1)
            if mr is not None:
                m = np.empty_like(d) if m is None else m
                m[r : r + rows] = mr.reshape(rows, -1)
            sups.append(sup)
        sup = SuperScales(
            torch.cat([x.dsup for x in sups]),
            torch.cat([x.sc for x in sups]),
            None if sups[0].mn is None else torch.cat([x.mn for x in sups]),
        )
        return QuantizedWeight(
            fmt, torch.from_numpy(q), torch.from_numpy(d), None if m is None else torch.from_numpy(m), sup=sup
        )
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = None
    if fmt == "Q8_0":
        q = blocks[..., 2:].copy()
    elif fmt in ("Q5_0", "Q5_1"):
        start = 4 if fmt == "Q5_1" else 2
        if fmt == "Q5_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qh = blocks[..., start : start + 4].copy().view("<u4")  # [n, blocks, 1]
        fifth = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
        packed = blocks[..., start + 4 :]
        q = np.concatenate([packed & 15, packed >> 4], axis=-1) | (fifth << 4)
        if fmt == "Q5_0":
            q = (q.astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    elif fmt == "IQ4_NL":
        packed = blocks[..., 2:]
        q = IQ4_NL_VALUES[np.concatenate([packed & 15, packed >> 4], axis=-1)].view(np.uint8)
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


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block, as fp32 ``[..., 1]``."""
    return blocks[..., at : at + 2].copy().view(np.float16).astype(np.float32)


def _super(
    blocks: np.ndarray, sc: np.ndarray, mn: np.ndarray | None, with_dmin: bool, at: int = 0
) -> SuperScales:
    """The file's super-block scales (``SuperScales``) of blocks ``[n, supers, bytes]``, ``d`` at
    byte ``at`` (``dmin`` after it where ``with_dmin``)."""
    n, supers = blocks.shape[:2]
    dsup = np.zeros((n, supers, 2), np.int16)
    dsup[..., 0] = blocks[..., at : at + 2].copy().view(np.int16)[..., 0]
    if with_dmin:
        dsup[..., 1] = blocks[..., at + 2 : at + 4].copy().view(np.int16)[..., 0]
    return SuperScales(
        torch.from_numpy(dsup),
        torch.from_numpy(
            np.ascontiguousarray(sc.astype(np.int8 if not with_dmin else np.uint8)).reshape(n, -1)
        ).view(torch.uint8),
        None if mn is None else torch.from_numpy(np.ascontiguousarray(mn.astype(np.uint8)).reshape(n, -1)),
    )


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins from their 12 bytes. Sub-blocks 0-3
    have theirs in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 have their low 4 bits
    in the nibbles of bytes 8-11 and their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    lo, hi, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([lo & 63, (extra & 15) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (extra >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _low_nibbles_by_pair(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 values 0..15: sub-blocks 2p and 2p + 1 are the low and high nibbles of
    bytes 32p .. 32p + 31."""
    pairs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([pairs & 15, pairs >> 4], axis=-2).reshape(*qs.shape[:-1], QK_K)


def _read_q4_k(blocks):
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scales_and_mins(blocks[..., 4:16])
    return _low_nibbles_by_pair(blocks[..., 16:144]), d * sc, -(dmin * mn), _super(blocks, sc, mn, True)


def _read_q5_k(blocks):
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scales_and_mins(blocks[..., 4:16])
    high = blocks[..., 16:48]  # bit j of byte i: the fifth bit of sub-block j's element i
    bits = (high[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = _low_nibbles_by_pair(blocks[..., 48:176]) | (bits.reshape(*blocks.shape[:-1], QK_K) << 4)
    return q, d * sc, -(dmin * mn), _super(blocks, sc, mn, True)


def _read_q6_k(blocks):
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    lead = blocks.shape[:-1]
    # each half of 128 values: values 32c + i take the low (c < 2) or high nibble of ql byte
    # 32 (c % 2) + i and bits 2c, 2c + 1 of qh byte i
    low = ql.reshape(*lead, 2, 1, 64)
    low = np.concatenate([low & 15, low >> 4], axis=-2).reshape(*lead, 2, 4, 32)
    high = (qh.reshape(*lead, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    return q.reshape(*lead, QK_K), _f16(blocks, 208) * scales, None, _super(blocks, scales, None, False, 208)


def _read_q3_k(blocks):
    """Q3_K (ggml-common.h): 32 bytes of high bits, 64 of 2-bit pairs, 12 of 6-bit scales, f16 d.
    Value 32j + i (j = 0..7) takes bits 2(j % 4), 2(j % 4) + 1 of pair byte 32(j // 4) + i and bit j
    of high byte i; the quant is ``low - 4`` where that bit is clear, ``low`` where set (-4..3).
    The 16 scales: low nibbles of bytes 0-7 (scales 0-7) then their high nibbles (8-15), each with 2
    high bits from bytes 8-11 (byte 8 + t % 4, bits 2(t // 4)), minus 32."""
    lead = blocks.shape[:-1]
    hmask, qs, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    low = (qs.reshape(*lead, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., 2, 4, 32]
    high = (hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [.., 8, 32]
    q = low.reshape(*lead, 8, 32).astype(np.int8) - 4 * (1 - high.astype(np.int8))
    lo = np.concatenate([packed[..., 0:8] & 15, packed[..., 0:8] >> 4], axis=-1)
    hi = (packed[..., 8:12][..., None, :] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., 4, 4]
    scales = (lo | (hi.reshape(*lead, 16) << 4)).astype(np.int16) - 32
    scales = scales.astype(np.float32)
    d = _f16(blocks, 108) * scales
    return q.view(np.uint8).reshape(*lead, QK_K), d, None, _super(blocks, scales, None, False, 108)


def _read_q2_k(blocks):
    """Q2_K (ggml-common.h): 16 bytes of sub-block scales (low nibble) and mins (high nibble), 64
    bytes of 2-bit quants, f16 d, f16 dmin. Value 128h + 32j + i (h = 0, 1; j = 0..3) is bits 2j,
    2j + 1 of quant byte 32h + i; sub-block t is values 16t .. 16t + 15, its weight
    ``d * sc_t * q - dmin * mn_t`` (each product rounded to fp32: here ``d`` and ``m = -(dmin * mn)``
    per 16, the U8_16 form)."""
    lead = blocks.shape[:-1]
    packed, qs = blocks[..., 0:16], blocks[..., 16:80]
    q = (qs.reshape(*lead, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [.., 2, 4, 32]
    sc, mn = (packed & 15).astype(np.float32), (packed >> 4).astype(np.float32)
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    return q.reshape(*lead, QK_K), d * sc, -(dmin * mn), _super(blocks, sc, mn, True, 80)


def _read_iq4_xs(blocks):
    """IQ4_XS (ggml-common.h): f16 d, a little-endian uint16 of the 8 sub-blocks' high scale bits
    (2 each, sub-block j at bits 2j), 4 bytes of their low scale bits (sub-block j: the low nibble
    of byte j // 2 for even j, the high for odd), then 8 x 16 bytes of nibbles laid out as IQ4_NL's
    blocks (byte t: value t low, t + 16 high), each indexing ``IQ4_NL_VALUES``. Sub-block j's weight
    is ``d * (scale_j - 32) * value`` with ``d * (scale_j - 32)`` rounded to fp32 (exact): read into
    the Q8_0 form, a scale per 32."""
    lead = blocks.shape[:-1]
    high = blocks[..., 2:4].copy().view("<u2")  # [.., 1]
    low = blocks[..., 4:8]
    lo = np.stack([low & 15, low >> 4], axis=-1).reshape(*lead, 8)
    hi = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3
    scales = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32  # -32..31
    nib = blocks[..., 8:136].reshape(*lead, 8, 16)
    idx = np.concatenate([nib & 15, nib >> 4], axis=-1)  # [.., 8, 32]
    q = IQ4_NL_VALUES[idx].view(np.uint8).reshape(*lead, QK_K)
    sc = scales.astype(np.float32)
    return q, _f16(blocks, 0) * sc, None, _super(blocks, sc, None, False, 0)


_K_READERS = {
    "Q4_K": _read_q4_k,
    "Q5_K": _read_q5_k,
    "Q6_K": _read_q6_k,
    "Q3_K": _read_q3_k,
    "Q2_K": _read_q2_k,
    "IQ4_XS": _read_iq4_xs,
}


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


def call_packed(linear, code: int, x: torch.Tensor, refusal: str) -> torch.Tensor:
    """``linear``'s packed GEMM on ``x``: quant_gemm.c and quant_int8act.c take the same arguments
    (format code, rows, packed weight, bias, output, threads) and return nonzero to refuse."""
    lead, x2, y = rows_in_and_out(x, linear.in_features, linear.out_features)
    m = x2.shape[0]
    if m:
        rc = linear._gemm(
            code,
            x2.data_ptr(),
            m,
            linear.in_features,
            x2.stride(0),
            linear._packed_ptr,
            linear.out_features,
            linear._bias_ptr,
            y.data_ptr(),
            linear.out_features,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"{refusal} {linear.fmt} with k={linear.in_features} ({rc})")
    return y.view(*lead, linear.out_features)


def native_entry(linear, code: int) -> NativeEntry:
    """``linear``'s GEMM as ``call_packed`` runs it, for native callers (``NativeEntry``)."""
    ptrs = (linear._packed_ptr, linear._bias_ptr)
    return NativeEntry(fn_address(linear._gemm), code, *ptrs, linear.out_features, linear.in_features)


class QuantLinear:
    """``F.linear(x, W, bias)`` with ``W`` as a ``QuantizedWeight`` (or a ``MixedRows``: each part
    packed in its own format), packed at construction."""

    kind = "quantized"

    def __init__(
        self, weight: QuantizedWeight | MixedRows, bias: torch.Tensor | None = None, *, isa: str | None = None
    ):
        lib = library(isa)
        if lib is None:
            raise RuntimeError("the quantized GEMM has no build here")
        self.isa = isa or native_build.chosen_isa()
        self.fmt = weight.fmt
        self.out_features, self.in_features = weight.shape
        if isinstance(weight, MixedRows):
            self._code = SEGMENTS
            parts = [(FORMATS[p.fmt], p.shape[0], QuantLinear(p, isa=isa).packed) for p in weight.parts]
            self.packed = pack_segments(parts)
        else:
            self._code = FORMATS[weight.fmt]
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

    def native_entry(self) -> NativeEntry:
        return native_entry(self, self._code)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return call_packed(self, self._code, x, "quant_gemm refused format")
