"""Packed weights on 2 MiB transparent huge pages (kernels/cpu/packed_memory.py)."""

import torch

from kernels.cpu import packed_memory
from kernels.cpu.packed_memory import HUGE, packed_empty, thp_mode


def _anon_huge_in(lo: int, hi: int) -> int:
    """AnonHugePages (bytes) of the mappings overlapping [lo, hi)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and lo < b
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) << 10
    return total


def test_big_buffer_is_aligned_zeroed_writable_and_on_huge_pages(monkeypatch):
    monkeypatch.setenv("LLMSERVE_HUGE_PAGES", "1")
    mode = thp_mode()
    if mode in (None, "never"):
        import pytest

        pytest.skip(f"this kernel gives no transparent huge pages ({mode or 'no THP'})")
    t = packed_empty((3 * HUGE + 4096) // 2, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.numel() == (3 * HUGE + 4096) // 2 and t.is_contiguous()
    assert t.data_ptr() % HUGE == 0
    assert not t.view(torch.uint8).any()
    t.fill_(1.5)
    lo = t.data_ptr()
    view = t[HUGE // 2 :]  # a view keeps the mapping alive once the tensor is gone
    del t
    assert (view == 1.5).all()
    assert _anon_huge_in(lo, lo + 3 * HUGE + 4096) > 0
    assert "2 MiB pages" in packed_memory.state()


def test_turned_off_or_small_is_a_heap_tensor(monkeypatch):
    monkeypatch.setenv("LLMSERVE_HUGE_PAGES", "0")
    t = packed_empty(3 * HUGE, torch.uint8)
    assert t.numel() == 3 * HUGE and t.untyped_storage().nbytes() == 3 * HUGE
    assert "4 KiB pages (LLMSERVE_HUGE_PAGES=0)" in packed_memory.state()
    monkeypatch.setenv("LLMSERVE_HUGE_PAGES", "1")
    small = packed_empty(1000, torch.float32)
    assert small.numel() == 1000 and small.untyped_storage().nbytes() == 4000
