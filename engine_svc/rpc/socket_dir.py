"""The private directory that holds a launcher's engine sockets, and its cleanup.

``llmserve serve`` puts its engines' unix sockets in a fresh 0700 directory named after its own
pid, ``/tmp/llmserve-<pid>-XXXXXXXX``. The launcher removes it when it exits; when it is killed
(SIGKILL runs no cleanup), the engine, which exits once its parent is gone, removes it, and
failing that the next launcher's start sweeps every such directory whose owner is dead, as the
shared-memory sweep does for rings.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from engine_svc.rpc.pids import alive

_NAME = re.compile(r"^llmserve-(\d+)-[a-z0-9_]{8}$")  # tempfile.mkdtemp's 8 random characters


def make_private_dir() -> str:
    return tempfile.mkdtemp(prefix=f"llmserve-{os.getpid()}-")  # 0700: only this user reaches it


def owner_pid(directory: str | Path) -> int | None:
    m = _NAME.match(Path(directory).name)
    return int(m.group(1)) if m else None


def remove_if_owner_gone(directory: str | Path) -> bool:
    """Remove a private socket directory whose launcher is dead (its sockets first); True if
    removed. A live owner's directory is left alone: it may be restarting an engine in it."""
    d = Path(directory)
    pid = owner_pid(d)
    if pid is None or alive(pid) or not d.is_dir() or d.stat().st_uid != os.getuid():
        return False
    for entry in d.iterdir():
        if entry.is_socket():
            entry.unlink(missing_ok=True)
    try:
        d.rmdir()  # fails if anything else is in it: nothing but sockets is ours to delete
    except OSError:
        return False
    return True


def sweep_stale_dirs(root: str | Path | None = None) -> list[str]:
    """Remove this user's private socket directories of dead launchers; return their paths."""
    base = Path(root or tempfile.gettempdir())
    removed = []
    for d in base.glob("llmserve-*-*"):
        try:
            if remove_if_owner_gone(d):
                removed.append(str(d))
        except OSError:
            continue  # gone meanwhile, or another user's
    return removed
