"""How many decoder layers this process has run: bumped as each layer of a forward pass completes
(the Python layer loop here, the native loop in C through ``ADDRESS``), read by the engine's
watchdog from its own thread. A step whose layers keep advancing is slow, not hung.

One counter per process (an engine process serves one engine; a draft model's layers count too:
they are the same step's work). Only its changes mean anything: it is never reset.
"""

from __future__ import annotations

import ctypes

_count = ctypes.c_int64(0)
# The native loop adds one per layer here (a relaxed atomic add), with the GIL released.
ADDRESS = ctypes.addressof(_count)


def bump() -> None:
    _count.value += 1


def value() -> int:
    """The layers run so far (an aligned 8-byte load: safe while the native loop adds to it)."""
    return _count.value
