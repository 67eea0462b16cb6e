"""Linears on quantized weights with int8 activations (``kernels/cpu/native/quant_int8act.c``):
each call quantizes its rows of ``x`` to int8 in blocks of 32 (one fp32 scale a block, the block's
quant sum for the formats with minimums) and multiplies the weights' integer quants by them in
integer block dot products, as llama.cpp does; AVX-512 VNNI where the CPU has it.

The result is not the fp32-activation GEMM's (``quant_gemm.QuantLinear``: bit-equal to fp32 on the
dequantized weight) but the documented quantized math, the same bits on every instruction set, for
a row alone or in any batch, at any thread count. ``reference`` is an independent float64 statement
of it for tests.

Formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants, whose math is that of expanded forms (Q4_K
as Q4_1, Q5_K as U8_1, Q6_K and Q3_K as I8_16: int8 quants with a scale per 16 weights, so a
32-step block of activations meets two weight sub-blocks: ``(dw0 * dx) * isum0 + (dw1 * dx) *
isum1``), served from their super-blocks (``K_FORMATS``: the file's fp16 scales and integer
sub-block scales, each block's scale made in the kernel as an exact product, the file's bytes).
Q2_K (2-bit quants, a scale and a minimum per 16 weights: I8_16's math plus each half's minimum
term ``mw_h * (dx * sh_h)``) is served from its super-blocks only, at the file's 84 bytes per 256
weights. IQ4_XS is Q8_0's math on IQ4_NL's table values with a scale per 32 (``d * (scale - 32)``,
exact), served from its super-blocks: nibble indices looked up in the kernel.
Q5_0 and Q5_1 are packed as the file holds them, nibbles plus a plane of fifth bits (0.69 and 0.75
bytes a weight with their fp16 scales): Q5_0 is Q4_0's math with quants ``q - 16``, Q5_1 Q4_1's.
IQ4_NL runs as Q8_0 (its table's int8 values, one byte each).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from kernels.cpu import native_build
from kernels.cpu.native_gemm import NativeEntry, fn_address
from kernels.cpu.quant_gemm import (
    SEGMENTS,
    SIGNED,
    MixedRows,
    QuantizedWeight,
    call_packed,
    native_entry,
    pack_segments,
)

# quant_int8act.c's FMT_*: the weight's form, by the format name a QuantizedWeight carries.
FORMATS = {
    "Q8_0": 0,
    "Q4_0": 1,
    "Q4_1": 2,
    "Q4_K": 2,
    "Q5_K": 3,
    "Q6_K": 4,
    "Q3_K": 4,
    "Q5_0": 5,
    "Q5_1": 6,
    "IQ4_NL": 0,
    "IQ4_XS": 0,
}
HALF = 8  # + to a format code: its scales (and minimums) packed as fp16
# The K-quants served from their super-blocks (quant_int8act.c's FMT_K forms): the math of the
# expanded form above, the weight read at the file's size (Q4_K 0.58 bytes a weight against 0.75
# as Q4_1, Q5_K 0.70 against 1.25, Q6_K 0.82 against 1.25).
# Q2_K (a scale and a minimum per 16 weights, 2-bit quants) has no expanded form here: it is served
# from its super-blocks only (the file's 0.33 bytes a weight). IQ4_XS is Q8_0's math on its table's
# values (its nibbles looked up in the kernel: 0.54 bytes a weight, the expanded Q8_0 form 1.13).
K_FORMATS = {"Q4_K": 16 | 2, "Q5_K": 16 | 6, "Q6_K": 16 | 4, "Q3_K": 16 | 8 | 4, "Q2_K": 16 | 7, "IQ4_XS": 16}
K_ONLY = ("Q2_K",)
QK_K = 256
SUB_BLOCK = {"Q6_K": 16, "Q3_K": 16, "Q2_K": 16}  # weights a scale, where not a whole block of 32
SIGNED_SCALES = ("Q6_K", "Q3_K", "IQ4_XS")  # super-block integer scales stored as int8 bits
QK = 32

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "llmserve_qi8_pack": ([_I32, _P, _P, _P, _I64, _I64, _P], _I32),
    "llmserve_qi8_pack_k": ([_I32, _P, _P, _P, _P, _I64, _I64, _P], _I32),
    "llmserve_qi8_packed_bytes": ([_I32, _I64, _I64], _I64),
    "llmserve_qi8_gemm": ([_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], _I32),
    "llmserve_qi8_gemm_silu": ([_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], _I32),
    "llmserve_qi8_gemm_gelu_tanh": ([_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], _I32),
    "llmserve_qi8_quantize_glu": ([_I32, _P, _I64, _I64, _I64, _P, _P, _P, _P], _I32),
    "llmserve_qi8_gemm_argmax": ([_I32, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _P, _I32], _I32),
    "llmserve_qi8_mlp": (
        [_I32, _I32, _P, _I64, _I64, _I64, _P, _P, _I64, _I32, _P, _I64, _P, _P, _I64, _I32],
        _I32,
    ),
    "llmserve_qi8_quantize": ([_P, _I64, _I64, _I64, _P, _P, _P, _P], None),
    "llmserve_qi8_vnni": ([_I32], _I32),
    "llmserve_qi8_amx": ([_I32], _I32),
    "llmserve_qi8_unpack_from": ([_I32, _I32], _I32),
    "llmserve_qi8_panel_width": ([], _I32),
}


def library(isa: str | None = None):
    return _library(isa or native_build.chosen_isa())


@functools.cache
def _library(isa: str):
    return native_build.load_with_signatures("quant_int8act", isa, _SIGNATURES)


def supports(fmt: str) -> bool:
    """Whether the kernel runs ``fmt`` (a ``MixedRows``' ``Q5_0+Q8_0``: every part's)."""
    return all(f in FORMATS or f in K_ONLY for f in fmt.split("+"))


def unusable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"device is {device.type}"
    if library() is None:
        return "no native build of quant_int8act (see the log)"
    return None


def variant(isa: str | None = None) -> str:
    """What the dot products run on: ``avx512 VNNI``, ``avx512``, ``avx2`` or ``generic``."""
    isa = isa or native_build.chosen_isa()
    lib = library(isa)
    if lib is None or not lib.llmserve_qi8_vnni(-1):
        return isa
    return f"{isa} VNNI + AMX" if lib.llmserve_qi8_amx(-1) else f"{isa} VNNI"


UNPACK_CLASSES = ("Q4_0/Q4_1/Q3_K", "fifth bit", "Q4_K", "Q6_K, K <= 4096", "Q6_K, longer K")


def unpack_from(rows: list[int] | None = None, isa: str | None = None) -> list[int]:
    """From how many rows a work item unpacks its weight panel once, per ``UNPACK_CLASSES`` (the
    AVX-512 VNNI build; below it each pass of rows unpacks its own): the values before the call,
    and with ``rows`` (one value a class) those set. The bits are the same on either path; tests
    and benchmarks move them to reach both."""
    lib = library(isa)
    if lib is None:
        raise RuntimeError("no native build of quant_int8act")
    return [lib.llmserve_qi8_unpack_from(i, rows[i] if rows else -1) for i in range(len(UNPACK_CLASSES))]


class Int8ActLinear:
    """``F.linear(x, W, bias)`` with ``W`` a ``QuantizedWeight`` and ``x`` quantized to int8 per
    call (the module docstring's math), packed at construction."""

    kind = "quantized_int8act"

    def __init__(
        self,
        weight: QuantizedWeight | MixedRows,
        bias: torch.Tensor | None = None,
        *,
        isa: str | None = None,
        half_scales: bool | None = None,
        super_blocks: bool = True,
    ):
        """``half_scales``: pack the scales as fp16 (None: where they all are fp16 values). A
        ``MixedRows`` packs each part in its own format (``quant_gemm.pack_segments``).
        ``super_blocks``: a K-quant that carries its file's super-block scales (``weight.sup``) is
        served from its super-blocks (``K_FORMATS``); False packs it in the expanded form (the
        same results, more bytes: for tests)."""
        if not supports(weight.fmt):
            raise ValueError(f"no int8-activation kernel for {weight.fmt}")
        lib = library(isa)
        if lib is None:
            raise RuntimeError("the int8-activation GEMM has no build here")
        self.isa = isa or native_build.chosen_isa()
        self.fmt = weight.fmt
        self.out_features, self.in_features = weight.shape
        if self.in_features % QK:
            raise ValueError(f"rows of {self.in_features} are not whole blocks of {QK}")
        if isinstance(weight, MixedRows):
            parts = [
                Int8ActLinear(p, isa=isa, half_scales=half_scales, super_blocks=super_blocks)
                for p in weight.parts
            ]
            self.code = SEGMENTS
            self.half_scales = all(p.half_scales for p in parts)
            self.packed = pack_segments([(p.code, p.out_features, p.packed) for p in parts])
        elif super_blocks and weight.fmt in K_FORMATS and weight.sup is not None:
            self.code = K_FORMATS[weight.fmt]
            self.half_scales = True
            self._pack_super(lib, weight)
        elif weight.fmt in K_ONLY:
            raise ValueError(f"{weight.fmt} runs from its file's super-block scales only (weight.sup)")
        else:
            self.code = FORMATS[weight.fmt]
            self._pack(lib, weight, half_scales)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._gemm = lib.llmserve_qi8_gemm
        self._packed_ptr = self.packed.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def _pack(self, lib, weight: QuantizedWeight, half_scales: bool | None) -> None:
        q = weight.q.contiguous()
        d = weight.d.float().contiguous()
        m = None if weight.m is None else weight.m.float().contiguous()
        # Scales that are all fp16 values (a GGUF file's Q8_0 / Q4_* blocks) are packed as fp16:
        # read back exactly, fewer bytes per weight (Q4_1: 0.625 against 0.75).
        exact = all(t is None or torch.equal(t.half().float(), t) for t in (d, m))
        if half_scales and not exact:
            raise ValueError("half_scales: the scales are not all fp16 values")
        self.half_scales = exact if half_scales is None else half_scales
        if self.half_scales:
            self.code |= HALF
            d = d.half()
            m = None if m is None else m.half()
        self.packed = torch.empty(
            lib.llmserve_qi8_packed_bytes(self.code, self.out_features, self.in_features), dtype=torch.uint8
        )
        rc = lib.llmserve_qi8_pack(
            self.code,
            q.data_ptr(),
            d.data_ptr(),
            None if m is None else m.data_ptr(),
            self.out_features,
            self.in_features,
            self.packed.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"quant_int8act refused to pack {self.fmt} {weight.shape}")

    def _pack_super(self, lib, weight: QuantizedWeight) -> None:
        """The K form from the file's super-block scales; refused where they do not make the
        weight's fp32 scales exactly (a ``sup`` that does not belong to these rows)."""
        sup, n, k = weight.sup, self.out_features, self.in_features
        if k % QK_K:
            raise ValueError(f"{weight.fmt}: rows of {k} are not whole super-blocks of {QK_K}")
        dsup = sup.dsup.contiguous().view(torch.float16).float()  # [n, k/256, 2]
        per = weight.d.shape[1] // (k // QK_K)  # scales a super-block: 8 (Q6_K, Q3_K, Q2_K: 16)
        sc = sup.sc.view(torch.int8) if weight.fmt in SIGNED_SCALES else sup.sc
        d = (dsup[..., :1] * sc.float().view(n, -1, per)).view(n, -1)
        ok = torch.equal(d, weight.d.float())
        if sup.mn is not None:
            ok = ok and torch.equal(
                -(dsup[..., 1:] * sup.mn.float().view(n, -1, per)).view(n, -1), weight.m.float()
            )
        if not ok:
            raise ValueError(f"{weight.fmt}: the super-block scales do not make the weight's scales")
        q = weight.q.contiguous()
        self.packed = torch.empty(lib.llmserve_qi8_packed_bytes(self.code, n, k), dtype=torch.uint8)
        mn = None if sup.mn is None else sup.mn.contiguous()
        dbits, scb = sup.dsup.contiguous(), sup.sc.contiguous()
        rc = lib.llmserve_qi8_pack_k(
            self.code,
            q.data_ptr(),
            dbits.data_ptr(),
            scb.data_ptr(),
            None if mn is None else mn.data_ptr(),
            n,
            k,
            self.packed.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"quant_int8act refused to pack {self.fmt} {weight.shape} from super-blocks")

    def native_entry(self) -> NativeEntry:
        return native_entry(self, self.code)

    def glu_entry(self, gelu: bool = False) -> NativeEntry:
        """The down projection fused with its MLP's gated activation (``llmserve_qi8_gemm_silu``,
        ``..._gelu_tanh``): the same arguments as ``native_entry``'s, its rows ``[gate | up]`` (2 x
        ``in_features``), the result bit for bit this linear of elementwise.c's SiLU- (GELU-tanh-)
        and-multiply rows at this linear's instruction set, which it never writes."""
        fn = self._glu_fns[bool(gelu)]
        ptrs = (self._packed_ptr, self._bias_ptr)
        return NativeEntry(fn_address(fn), self.code, *ptrs, self.out_features, self.in_features)

    @functools.cached_property
    def _glu_fns(self):
        lib = library(self.isa)
        return lib.llmserve_qi8_gemm_silu, lib.llmserve_qi8_gemm_gelu_tanh

    def glu(self, gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))`` (``gelu``: GELU-tanh) through the fused entry
        (``glu_entry``): ``gate_up`` rows of 2 x ``in_features`` fp32, for tests."""
        k, n = self.in_features, self.out_features
        x = gate_up.float().contiguous().reshape(-1, 2 * k)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        if x.shape[0]:
            rc = self._glu_fns[bool(gelu)](
                self.code, x.data_ptr(), x.shape[0], k, 2 * k, self._packed_ptr, n, self._bias_ptr,
                y.data_ptr(), n, torch.get_num_threads(),
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"quant_int8act failed on {self.fmt} with k={k} ({rc})")
        return y.view(*gate_up.shape[:-1], n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return call_packed(self, self.code, x, "quant_int8act failed on")


def quantize_activations(x: torch.Tensor, isa: str | None = None):
    """The kernel's own int8 form of ``x`` ``[m, k]`` fp32: (q int8 ``[m, k]``, dx fp32, sx int32,
    dxs fp32, each ``[m, k / 32]``), for tests."""
    x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    dx, dxs = torch.empty(m, k // QK), torch.empty(m, k // QK)
    sx = torch.empty(m, k // QK, dtype=torch.int32)
    library(isa).llmserve_qi8_quantize(
        x.data_ptr(), m, k, k, q.data_ptr(), dx.data_ptr(), sx.data_ptr(), dxs.data_ptr()
    )
    return q, dx, sx, dxs


def fused_mlp_fn(gate_up, down):
    """``llmserve_qi8_mlp`` (a layer's gate/up, activation and down projection in one call, the
    gate/up outputs never stored) for these two linears, or None where it does not take them: not
    both int8-activation linears of one instruction set, row segments, or an intermediate width
    that is not a multiple of 64."""
    if type(gate_up) is not Int8ActLinear or type(down) is not Int8ActLinear or gate_up.isa != down.isa:
        return None
    inter = down.in_features
    if SEGMENTS in (gate_up.code, down.code) or inter % 64 or gate_up.out_features != 2 * inter:
        return None
    return library(down.isa).llmserve_qi8_mlp


def mlp(gate_up: Int8ActLinear, down: Int8ActLinear, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``down(silu_and_mul(gate_up(x)))`` (``gelu``: GELU-tanh) through ``fused_mlp_fn``, for tests."""
    fn = fused_mlp_fn(gate_up, down)
    if fn is None:
        raise ValueError("the fused MLP does not take these linears")
    k, inter, n = gate_up.in_features, down.in_features, down.out_features
    x = x.float().contiguous().reshape(-1, k)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    gu_ptrs, dn_ptrs = (gate_up._packed_ptr, gate_up._bias_ptr), (down._packed_ptr, n, down._bias_ptr)
    rc = fn(
        2 if gelu else 1, gate_up.code, x.data_ptr(), x.shape[0], k, k, *gu_ptrs, inter, down.code, *dn_ptrs,
        y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"quant_int8act's fused MLP failed ({rc})")
    return y


def quantize_glu_activations(gate_up: torch.Tensor, gelu: bool = False, isa: str | None = None):
    """``quantize_activations`` of SiLU- (``gelu``: GELU-tanh-) and-multiply of ``gate_up`` ``[m, 2k]``
    as the fused down projection makes them (the fp32 product never written), for tests."""
    x = gate_up.float().contiguous()
    m, k = x.shape[0], x.shape[1] // 2
    q = torch.empty(m, k, dtype=torch.int8)
    dx, dxs = torch.empty(m, k // QK), torch.empty(m, k // QK)
    sx = torch.empty(m, k // QK, dtype=torch.int32)
    ptrs = (q.data_ptr(), dx.data_ptr(), sx.data_ptr(), dxs.data_ptr())
    rc = library(isa).llmserve_qi8_quantize_glu(2 if gelu else 1, x.data_ptr(), m, k, 2 * k, *ptrs)
    if rc != 0:
        raise RuntimeError(f"quant_int8act refused the gated quantization ({rc})")
    return q, dx, sx, dxs


def reference(
    x: torch.Tensor, weight: QuantizedWeight | MixedRows, bias: torch.Tensor | None = None
) -> np.ndarray:
    """The kernel's math in numpy, written from the documented steps, not from the C: activations
    quantized in fp32 (``dx = max|x| / 127``, ``q = rint(x / dx)`` by the reciprocal, ties to even,
    zeros where ``dx`` is below the smallest normal float),
    integer block dot products in int64, then per output over the blocks in order
    ``acc += fp32(fp32(dw * dx) * isum) [+ fp32(mw * fp32(dx * sx))]`` each step rounded to fp32
    (Q6_K, Q3_K, a scale per 16: ``acc += fp32(t0 + t1)``, ``t_h = fp32(fp32(dw_h * dx) * isum_h)``
    over the block's two halves; Q2_K, a minimum per 16 too: ``t_h += fp32(mw_h * fp32(dx * sh_h))``,
    ``sh_h`` the half's sum of q), and ``+ bias``. Returns fp32 ``[m, n]``."""
    f32 = np.float32
    if isinstance(weight, MixedRows):  # each part's outputs are its own kernel's
        outs, r0 = [], 0
        for part in weight.parts:
            b = None if bias is None else bias[r0 : r0 + part.shape[0]]
            outs.append(reference(x, part, b))
            r0 += part.shape[0]
        return np.concatenate(outs, axis=1)
    xs = x.detach().float().numpy()
    m, k = xs.shape
    nb = k // QK
    xb = xs.reshape(m, nb, QK)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        dx = (np.abs(xb).max(-1) / f32(127)).astype(f32)
        inv = np.where(dx >= np.finfo(f32).tiny, f32(1) / dx, f32(0)).astype(f32)
    qx = np.clip(np.rint((xb * inv[..., None]).astype(f32)), -127, 127).astype(np.int64)
    sx = qx.sum(-1)
    dxs = (dx * sx.astype(f32)).astype(f32)
    q = weight.q.view(torch.int8) if weight.fmt in SIGNED else weight.q
    qw = q.numpy().astype(np.int64).reshape(-1, nb, QK)
    if weight.fmt == "Q4_0":
        qw = qw - 8
    dw = weight.d.float().numpy()
    mw = None if weight.m is None else weight.m.float().numpy()
    acc = np.zeros((m, qw.shape[0]), f32)
    if weight.fmt in SUB_BLOCK:  # two scales a block: one integer sum and one term per half
        halves = np.einsum("mbhk,nbhk->mnbh", qx.reshape(m, nb, 2, QK // 2), qw.reshape(-1, nb, 2, QK // 2))
        # Q2_K: a minimum per half too, times dx * (the half's sum of q)
        dxh = (dx[..., None] * qx.reshape(m, nb, 2, QK // 2).sum(-1).astype(f32)).astype(f32)
        for b in range(nb):
            t = []
            for h in (0, 1):
                th = (dw[None, :, 2 * b + h] * dx[:, None, b]).astype(f32) * halves[:, :, b, h].astype(f32)
                th = th.astype(f32)
                if mw is not None:
                    th = (th + (mw[None, :, 2 * b + h] * dxh[:, None, b, h]).astype(f32)).astype(f32)
                t.append(th)
            acc = (acc + (t[0] + t[1]).astype(f32)).astype(f32)
        if bias is not None:
            acc = (acc + bias.detach().float().numpy()[None, :]).astype(f32)
        return acc
    isum = np.einsum("mbk,nbk->mnb", qx, qw)  # exact in int64
    for b in range(nb):
        t = (dw[None, :, b] * dx[:, None, b]).astype(f32) * isum[:, :, b].astype(f32)
        t = t.astype(f32)
        if mw is not None:
            t = (t + (mw[None, :, b] * dxs[:, None, b]).astype(f32)).astype(f32)
        acc = (acc + t).astype(f32)
    if bias is not None:
        acc = (acc + bias.detach().float().numpy()[None, :]).astype(f32)
    return acc
