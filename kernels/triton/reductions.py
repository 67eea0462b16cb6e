"""Row reductions for the kernels, written so that they also run under the interpreter.

``tl.sum`` / ``tl.max`` / ``tl.zeros`` are themselves ``@triton.jit`` functions of
``triton.language``, decorated once when triton is imported: if that happened with the interpreter
off (any earlier import, e.g. by torch or transformers), the interpreter cannot call them. So the
kernels call ``tl.reduce`` (a builtin) directly with the library's own combine functions: compiled,
that is exactly ``tl.sum`` / ``tl.max``; interpreted, the interpreter recognises those combine
functions and reduces with numpy without calling them. Our own combine functions stand in should a
Triton release rename the library's (correct, only slower when interpreted).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


_SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)
_MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _maximum)


@triton.jit
def row_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM_COMBINE)


@triton.jit
def row_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MAX_COMBINE)
