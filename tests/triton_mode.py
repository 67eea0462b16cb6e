"""Choose, for a block of code, whether the Triton kernels run compiled or in Triton's interpreter.

Triton decides at decoration time (``@triton.jit``, i.e. when a kernel module is imported)
whether a kernel is compiled or interpreted, from ``TRITON_INTERPRET``. Setting the variable is not
enough if ``kernels.triton`` was imported earlier in the same process, and leaving it set would leak
into everything imported later. ``triton_mode(interpret)`` sets it, drops the kernel modules so the
next import decorates them in that mode, and on exit restores the variable and drops them again.
Tests use it to run the kernels on CPU tensors (interpreted) or to compile them for a GPU target
that this machine does not have (compiled, never launched).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

PACKAGE = "kernels.triton"


def _drop_kernel_modules() -> None:
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def triton_mode(interpret: bool) -> Iterator[None]:
    """Within the block, a fresh import of ``kernels.triton`` runs interpreted (or compiled)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    _drop_kernel_modules()
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
        _drop_kernel_modules()


def interpreted_kernels() -> contextlib.AbstractContextManager[None]:
    return triton_mode(interpret=True)
