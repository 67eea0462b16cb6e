"""Whether the chosen instruction set (``native_build.chosen_isa``) is one of a kernel's, memoized:
the wrappers ask once a layer (150 times a token at batch 1), and the answer reads the CPU's flags
and the platform each time (microseconds). The key holds what the answer depends on: the
``LLMSERVE_CPU_ISA`` value, and the functions that decide (tests replace them)."""

from __future__ import annotations

import os

from kernels.cpu import native_build

_chosen: dict[tuple, str] = {}


def chosen() -> str:
    """``native_build.chosen_isa()``, memoized on what it depends on: a library cached per
    instruction set is looked up with this on every call, so a later ``LLMSERVE_CPU_ISA`` is obeyed
    (a cache keyed on ``isa=None`` kept whatever set its first call saw)."""
    key = (native_build.chosen_isa, native_build.supported_isas, os.environ.get("LLMSERVE_CPU_ISA"))
    hit = _chosen.get(key)
    if hit is None:
        hit = _chosen[key] = native_build.chosen_isa()
    return hit


def chosen_isa_in(names: tuple[str, ...]) -> bool:
    return chosen() in names
