"""Host memory the kernel backs only as it is written: the CPU KV pool's storage.

``lazy_zeros`` returns a zero tensor on a private anonymous mapping of its own. Linux gives such a
mapping no page until one is first written: a read of a never-written page sees the shared zero
page (so it reads 0.0, which the kernels rely on: padded reads of never-written slots must not bring
NaNs into masked math), and a write faults in one zeroed page. A pool of many GiB therefore costs
no memory and no memset at start; its resident part grows with what the engine has written.

The mapping is made once and never resized or moved: the native layer loop, the attention kernels,
the KV tiers' transfers and copy-on-write block copies keep raw pointers into it.

It is fenced by an inaccessible page on each side (``PROT_NONE``), so the kernel never merges it with
a neighbouring anonymous mapping: its pages are exactly the virtual memory areas between the fences,
and ``resident_bytes`` reads their resident size from ``/proc/self/smaps``.

``MAP_NORESERVE``: under the kernel's default overcommit heuristic a mapping larger than what is
free is still made; the budget that sizes it (``kv_budget.py``) keeps it within what was available.

Small pages (no ``MADV_HUGEPAGE``): measured (RT, 256 decodes x 400 positions over blocks scattered in
a 27,000-block pool, 6 layers), huge pages made attention 1.06x faster but the scattered blocks 4.2x
more resident (2,530 against 600 MiB) and the first writes up to 12x slower (compaction): no gain.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

PAGE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value (Python < 3.10 lacks the name)
_PROT_NONE = 0


class _Region:
    """One mapping: the usable bytes ``[start, start + size)`` between two fence pages."""

    def __init__(self, nbytes: int):
        self.size = -(-max(1, nbytes) // PAGE) * PAGE
        self.buf = mmap.mmap(
            -1,
            self.size + 2 * PAGE,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        whole = torch.frombuffer(self.buf, dtype=torch.uint8)
        base = whole.data_ptr()
        del whole
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for fence in (base, base + PAGE + self.size):
            if libc.mprotect(fence, PAGE, _PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect of a KV pool fence page failed")
        self.start = base + PAGE


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zero tensor of ``shape`` and ``dtype`` on a fenced anonymous mapping of its own:
    no page of it is resident until written. The tensor keeps the mapping alive (``torch.frombuffer``
    holds the buffer); the mapping goes when the last view of it does."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    region = _Region(count * itemsize)
    flat = torch.frombuffer(region.buf, dtype=torch.uint8, count=count * itemsize, offset=PAGE)
    assert flat.data_ptr() == region.start
    return flat.view(dtype).view(shape)


def span(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """The address range ``[lo, hi)`` the distinct ``tensors`` cover, rounded out to pages."""
    lo = min(t.data_ptr() for t in tensors)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    return lo // PAGE * PAGE, -(-hi // PAGE) * PAGE


def resident_bytes(lo: int, hi: int, smaps: str = "/proc/self/smaps") -> int:
    """Resident bytes of the mappings that lie inside ``[lo, hi)`` (``Rss`` in ``smaps``): for a
    ``lazy_zeros`` tensor's ``span``, the pages written so far (a read of a never-written page maps
    the shared zero page, which ``Rss`` does not count). A mapping across an end of the range (part
    of a ``lazy_zeros`` tensor, or memory that is not one) cannot be split: ValueError."""
    total, inside = 0, False
    with open(smaps) as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = lo <= a and b <= hi
                if not inside and a < hi and lo < b:
                    raise ValueError(f"the mapping {head} crosses the range {lo:x}-{hi:x}: no resident split")
            elif inside and head == "Rss:":
                total += int(line.split()[1]) << 10
    return total
