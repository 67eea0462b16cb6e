"""Shared-memory segments that belong to llmserve: unguessable names, owner-only, swept when stale.

A name is ``llmserve_<creator pid>_<128 random bits>``: the pid lets a later process tell a
leftover of a dead creator from a live one, the random part keeps other local users from
guessing (and opening) it. Segments are created 0600 and hold only fixed binary layouts.

A segment's pages are reserved when it is made and mapped in by every process that opens it. A
tmpfs only hands out a page when it is first touched, so otherwise a /dev/shm too small (Docker's
default is 64 MiB) would fail mid-stream with SIGBUS rather than at the start, and the resident
set of both processes would creep up as the rings' write positions sweep through pages they have
not touched before, which looks exactly like a leak on a dashboard.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

from engine_svc.rpc.pids import alive

PREFIX = "llmserve_"
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(rf"^{PREFIX}(\d+)_[0-9a-f]{{32}}$")
_created_here: set[str] = set()  # the resource tracker holds one registration per name per process


def new_name() -> str:
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(16)}"


def create_segment(size: int) -> SharedMemory:
    """A fresh segment, mode 0600. The creator unlinks it; if the creator is killed, Python's
    resource tracker (and failing that, the next sweep) removes it."""
    seg = SharedMemory(name=new_name(), create=True, size=size)
    _created_here.add(seg.name.lstrip("/"))
    path = SHM_DIR / seg.name.lstrip("/")
    try:
        if path.exists():  # the POSIX mode is 0600 already; this makes it explicit against a lax umask
            os.chmod(path, 0o600)
        _reserve(path, size)
    except OSError:
        seg.close()
        seg.unlink()
        _created_here.discard(seg.name.lstrip("/"))
        raise
    _map_in(seg)
    return seg


def _reserve(path: Path, size: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise OSError(
                e.errno,
                f"{SHM_DIR} has no room for a {size}-byte segment (raise its size, e.g. docker "
                f"--shm-size, or use --transport grpc)",
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: touch only
            raise
    finally:
        os.close(fd)


def _map_in(seg: SharedMemory) -> None:
    """Touch every page of this process's mapping, so its resident set is whole from the start."""
    page = os.sysconf("SC_PAGE_SIZE")
    view = memoryview(seg.buf)
    try:
        sum(view[::page])
    finally:
        view.release()


def attach_segment(name: str) -> SharedMemory:
    """Open a segment made by another process without taking ownership of it.

    Python 3.11 registers attached segments with the resource tracker too, which would unlink the
    other process's segment when this one exits; so the registration is undone at once.
    """
    if not _NAME.match(name.lstrip("/")):
        raise ValueError(f"not an llmserve shared-memory segment name: {name!r}")
    seg = SharedMemory(name=name, create=False)
    if name.lstrip("/") not in _created_here:
        resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001 - no public API in 3.11
    _map_in(seg)
    return seg


def creator_pid(name: str) -> int | None:
    m = _NAME.match(name.lstrip("/"))
    return int(m.group(1)) if m else None


def list_segments() -> list[str]:
    """Names of this user's llmserve segments (any creator)."""
    if not SHM_DIR.is_dir():
        return []
    uid = os.getuid()
    out = []
    for p in SHM_DIR.iterdir():
        if _NAME.match(p.name):
            try:
                if p.stat().st_uid == uid:
                    out.append(p.name)
            except FileNotFoundError:
                continue
    return sorted(out)


def sweep_stale_segments() -> list[str]:
    """Unlink this user's llmserve segments whose creator is gone; return their names."""
    removed = []
    for name in list_segments():
        pid = creator_pid(name)
        if pid is not None and pid != os.getpid() and not alive(pid):
            try:
                (SHM_DIR / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
