"""Whether the process that owns a shared resource (a memory segment, a socket directory) still
lives: what the sweeps of dead owners' leftovers ask."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed launcher not yet reaped by its parent is a zombie: gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
