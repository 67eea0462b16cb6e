"""glibc malloc settings for the engine process.

glibc raises its mmap threshold each time a large block allocated by mmap is freed (up to 32 MiB),
so the heap's shape depends on the order of the first large buffers. Fixing both thresholds from the
start gives the steady state at once and keeps it.

The threshold must sit above a step's buffers (activations, logits, gathered K/V: a few MiB at the
benchmark shape). Below them, every such buffer is a fresh mmap that the kernel zero-fills page by
page on first touch, every step: a 256 KiB threshold, set here before, made the engine process run
at about 0.55x its offline speed (page faults, measured on the 55M benchmark model at one thread:
230 against 400-460 tok/s), the whole gap between our server and vLLM's at 16 streams. At 32 MiB
the buffers are reused from the heap; a trim threshold of twice that (glibc's own pairing) keeps
freed memory for the next step instead of returning and faulting it in again. The soak's engine
stays within its growth allowance either way (tests/test_soak.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("engine_svc.server")
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES


def fix_mmap_threshold() -> bool:
    """True when glibc took the setting (elsewhere: nothing to do, and nothing is changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        log.info("malloc settings not applied (not glibc?)")
    return ok
