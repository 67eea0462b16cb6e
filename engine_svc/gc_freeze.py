"""Keep Python's cyclic garbage collector off the heap that exists once an engine is up.

Every step allocates a few long-lived containers (prefix-cache entries, block hashes), so every
so often the collector runs a full pass over every tracked object: with torch and transformers
imported that is a few hundred thousand objects and ~80 ms, landing on a random decode step (on
average more than the whole per-step bookkeeping at 256 running). Freezing moves the objects alive
at startup out of the collector's sight, as vLLM does after its engine starts; garbage made later
is collected as usual.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc

_frozen = False


def freeze_startup_heap() -> None:
    """Once per process: the modules and the first engine stay frozen; cycles among them that become
    garbage later would not be collected, which is why this is not repeated for every engine a
    process (a test run, a benchmark) creates."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    gc.collect()
    gc.freeze()
    # At exit the heap goes back under the collector, so interpreter shutdown frees it as usual
    # (extension modules such as triton's report frozen objects as leaks otherwise).
    atexit.register(gc.unfreeze)


def return_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse, and a load frees much that is not coming back (the
    released float weights, the packing's and the file reader's buffers: 28 MiB on the default
    model, 91 MiB on Qwen2.5-Coder-0.5B, measured after the engine was up); hand those pages to
    the system, or RSS still counts them."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: nothing to do
