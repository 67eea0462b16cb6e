"""glibc malloc settings for the engine process.

glibc raises its mmap threshold each time a large block allocated by mmap is freed (up to 32 MiB).
A step's tensors vary in size with the batch, so after a few large ones every buffer comes from the
heap instead, and the heap keeps the high-water mark of a fragmented mix: the engine's resident set
crept up by tens of MiB over a soak although nothing leaked. Fixing the threshold keeps large
buffers on mmap, returned to the system when freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("engine_svc.server")
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 << 10


def fix_mmap_threshold() -> bool:
    """True when glibc took the setting (elsewhere: nothing to do, and nothing is changed)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 20))
    if not ok:
        log.info("malloc settings not applied (not glibc?)")
    return ok
