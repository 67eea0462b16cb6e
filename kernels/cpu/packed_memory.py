"""Where the CPU linears' packed weights live: on 2 MiB transparent huge pages where the kernel gives them.

A decode step streams every packed weight once. On 4 KiB pages that is a TLB miss every 4 KiB of the
stream (the 0.5B's Q4_K_M linears: ~95k pages a step); on 2 MiB pages one every 2 MiB.

``packed_empty`` maps each buffer of 2 MiB or more as a private anonymous mapping of its own, 2 MiB
longer than asked, and uses the part that starts on a 2 MiB boundary; it asks ``MADV_HUGEPAGE`` for
exactly the used bytes. The kernel makes a huge page only for a 2 MiB-aligned range wholly inside
the advised range, so the last partial 2 MiB of a buffer stays on small pages (no memory beyond what
is asked), and the unused head and tail of the mapping are never touched (no memory at all). The
tensor keeps the mapping alive (``torch.frombuffer`` holds it); it goes with the last view.

Where THP is off (``never`` in ``/sys/kernel/mm/transparent_hugepage/enabled``), not built in, or
``madvise`` refuses, or ``LLMSERVE_HUGE_PAGES=0``, the buffer is a plain ``torch.empty`` (small
pages); ``state()`` says which, for the load log. Buffers under 2 MiB stay on the heap.

These mappings are not fenced: a neighbouring anonymous mapping may merge with one, which is fine
for weights; the KV pool (``engine_svc/lazy_memory.py``) is fenced, so its resident count is not
confused by them.
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE = 2 << 20
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # Linux's value

_refused: list[str] = []  # why madvise failed, where it did


def thp_mode(path: str = _THP) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``); None where it has no THP."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def enabled() -> bool:
    return os.environ.get("LLMSERVE_HUGE_PAGES", "1").strip().lower() not in ("0", "false", "off", "no")


def _why_not() -> str | None:
    """Why a big buffer stays on small pages, or None where it may go on huge pages."""
    if not enabled():
        return "LLMSERVE_HUGE_PAGES=0"
    mode = thp_mode()
    if mode is None:
        return "no transparent huge pages in this kernel"
    if mode == "never":
        return "transparent huge pages: never"
    return None


def packed_empty(count: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous 1-D tensor of ``count`` elements of ``dtype`` for a packed weight: zero-filled
    and starting on a 2 MiB boundary where it goes on huge pages (2 MiB or more, THP available and
    not turned off), else ``torch.empty`` (contents undefined)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = count * itemsize
    if nbytes >= HUGE and _why_not() is None:
        flags, prot = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE
        buf = mmap.mmap(-1, nbytes + HUGE, flags=flags, prot=prot)
        probe = torch.frombuffer(buf, dtype=torch.uint8, count=1)
        base = probe.data_ptr()
        del probe
        offset = -base % HUGE
        try:
            buf.madvise(_MADV_HUGEPAGE, offset, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        except (OSError, ValueError, AttributeError) as e:
            _refused[:] = [f"madvise(MADV_HUGEPAGE) refused: {e}"]
            buf.close()
        else:
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
            assert flat.data_ptr() % HUGE == 0
            return flat.view(dtype)
    return torch.empty(count, dtype=dtype)


def anon_huge_bytes(smaps: str = "/proc/self/smaps_rollup") -> int:
    """The process's anonymous memory on huge pages (``AnonHugePages``), 0 where unreadable."""
    try:
        with open(smaps) as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def state() -> str:
    """One phrase for the load log: whether the packed weights go on 2 MiB pages, or why not."""
    why = _why_not() or (_refused[0] if _refused else None)
    if why:
        return f"packed weights on 4 KiB pages ({why})"
    return f"packed weights on 2 MiB pages (the process's AnonHugePages: {anon_huge_bytes() >> 20} MiB)"
