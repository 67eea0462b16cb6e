"""Greedy tokens from the LM head without the step's whole ``[rows, vocab]`` logits.

A step whose sample rows are all greedy (no logprobs, no logit controls) needs of the head's output
only each row's argmax. The head's packed GEMM (an int8-activation ``quant_int8act.Int8ActLinear``,
or a native fp32 / bf16 / fp16 ``native_gemm.NativeLinear``: a bf16 checkpoint's untied head, on
the AMX-BF16 tiles or the FMA panels) is run over the vocabulary a slice at a time into one small
buffer that stays in cache, and each slice's argmax is merged into the rows' best so far: the
logits of a 151,936-token vocabulary at 64-256 rows (39-156 MB of fp32, a fresh allocation each
step, so page faults too) are never written out whole, and the argmax reads them from cache
instead of memory.

The same bits: a slice is the GEMM's own packed panels (``llmserve_qi8_packed_bytes`` counts
whole panels of ``llmserve_qi8_panel_width`` columns, so a slice that starts on a panel is the
packed buffer from that panel on; ``NativeLinear.columns`` likewise), and each output of the
kernel is its own row and column's math, whatever the call's width. The merge keeps
``sampler.argmax_rows``' rule: the first maximum, a NaN counting as the maximum (numpy's argmax:
its first NaN), so the index equals the argmax of
the whole row (tests/test_greedy_head.py, ties and NaNs across slice boundaries included).

An int8-activation head goes further: one native call (``llmserve_qi8_gemm_argmax``) quantizes the
rows once, computes the outputs a 32-column panel at a time into a thread's tile in L1 / L2 and
scans each tile's rows as it is made, on every thread the GEMM runs on; a work item keeps its
group of panels' first maximum per row, and the groups are merged in column order under the same
rule. No logits are written at all, the activations are not quantized once a slice, and the
argmax runs on both cores (numpy's ran on one). ``LLMSERVE_GREEDY_HEAD_FUSED=0`` keeps the slices
(comparisons)."""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

# Columns a slice targets (rows x columns fp32 of about 4 MiB: 16k columns at 64 rows, 4k at 256);
# measured on Qwen2.5-Coder-0.5B's Q8_0 head (151,936 x 896) at 64 and 256 rows, 2-16k columns
# all within 10% of each other, the whole-vocabulary call and its argmax 1.3-1.45x slower.
SLICE_FLOATS = 1 << 20
MIN_SLICE = 1024
# Panels (32 columns) a work item of the fused int8 head scans: its per-row best is kept per group
# ([groups, rows] of value, index, NaN) and merged at the end; 16 panels make ~300 items over a
# 151,936-token vocabulary. Tests make it 1 (ties and NaNs across items).
GROUP_PANELS = 16


def fused_enabled() -> bool:
    return os.environ.get("LLMSERVE_GREEDY_HEAD_FUSED", "1") != "0"


class ChunkedArgmax:
    """``argmax_rows(linear(x))`` per row of ``x [R, in]`` (fp32), a vocabulary slice at a time."""

    def __init__(self, linear, panel: int, columns, fused=None):
        self.linear = linear
        self.panel = panel
        # columns(x, c0, w, out): the head's output columns [c0, c0 + w) of x's rows into out
        self.columns = columns
        # fused(x, best): every row's argmax into best (int64) in one native call; None: slices
        self.fused = fused
        self._buf = torch.empty(0)

    @classmethod
    def of(cls, linear) -> ChunkedArgmax | None:
        """The chunked argmax for ``linear``, or None where it is neither an int8-activation linear
        of one format whose panels can be sliced nor a native linear (then the caller takes the
        whole logits)."""
        from kernels.cpu.native_gemm import NativeLinear
        from kernels.cpu.quant_gemm import SEGMENTS
        from kernels.cpu.quant_int8act import Int8ActLinear, library

        if type(linear) is NativeLinear:
            return cls(linear, linear.panel, linear.columns)
        if type(linear) is not Int8ActLinear or linear.code == SEGMENTS:
            return None
        lib = library(linear.isa)
        if lib is None:
            return None
        panel = int(lib.llmserve_qi8_panel_width())
        n, k = linear.out_features, linear.in_features
        whole = lib.llmserve_qi8_packed_bytes(linear.code, n, k)
        one = lib.llmserve_qi8_packed_bytes(linear.code, panel, k)
        if panel <= 0 or one <= 0 or whole != one * ((n + panel - 1) // panel):
            return None  # not whole panels one after another: no slice is a suffix of the buffer
        fused = functools.partial(_int8act_argmax, linear, lib) if fused_enabled() else None
        return cls(linear, panel, functools.partial(_int8act_columns, linear, lib), fused)

    def width(self, rows: int) -> int:
        n = self.linear.out_features
        w = max(MIN_SLICE, SLICE_FLOATS // max(rows, 1))
        return min(n, max(self.panel, w // self.panel * self.panel))

    def __call__(self, x: torch.Tensor) -> np.ndarray:
        lin = self.linear
        n, k = lin.out_features, lin.in_features
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"the head takes rows of {k}, got {tuple(x.shape)}")
        if x.stride(-1) != 1 or x.dtype != torch.float32:
            x = x.float().contiguous()
        rows = x.shape[0]
        best_i = np.zeros(rows, dtype=np.int64)
        if not rows:
            return best_i
        if self.fused is not None:
            self.fused(x, best_i)
            return best_i
        width = self.width(rows)
        if self._buf.numel() < rows * width:
            self._buf = torch.empty(rows * width, dtype=torch.float32)
        flat = self._buf.numpy()
        best_v = np.full(rows, -np.inf, dtype=np.float32)
        nan_seen = np.zeros(rows, dtype=bool)
        every = np.arange(rows)
        for c0 in range(0, n, width):
            w = min(width, n - c0)
            self.columns(x, c0, w, self._buf)
            y = flat[: rows * w].reshape(rows, w)
            i = y.argmax(axis=-1)
            v = y[every, i]
            # A row's first NaN wins for good; else a strictly greater value (ties keep the first).
            v_nan = np.isnan(v)
            take = ~nan_seen & (v_nan | (v > best_v))
            best_i[take] = i[take] + c0
            best_v[take] = v[take]
            nan_seen |= v_nan
        return best_i


def _int8act_columns(lin, lib, x: torch.Tensor, c0: int, w: int, out: torch.Tensor) -> None:
    """An int8-activation head's output columns [c0, c0 + w) into ``out`` (its panels from c0 on
    are the packed buffer's suffix: ``ChunkedArgmax.of`` checked)."""
    k = lin.in_features
    offset = lib.llmserve_qi8_packed_bytes(lin.code, c0, k)
    bias = None if lin.bias is None else lin.bias[c0 : c0 + w].data_ptr()
    rc = lin._gemm(
        lin.code, x.data_ptr(), x.shape[0], k, x.stride(0), lin._packed_ptr + offset, w, bias,
        out.data_ptr(), w, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"quant_int8act failed on {lin.fmt} with k={k} ({rc})")


def _int8act_argmax(lin, lib, x: torch.Tensor, best: np.ndarray) -> None:
    """Each row's first maximum over an int8-activation head's outputs, in one native call."""
    k, n = lin.in_features, lin.out_features
    rc = lib.llmserve_qi8_gemm_argmax(
        lin.code, x.data_ptr(), x.shape[0], k, x.stride(0), lin._packed_ptr, n, lin._bias_ptr,
        GROUP_PANELS, best.ctypes.data, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"quant_int8act's greedy head failed on {lin.fmt} with k={k} ({rc})")
