"""The shared-memory token ring and its segments: layout, wrap-around, back-pressure, ownership."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from engine_svc.server import shm_segments
from engine_svc.server.shm_ring import HEADER_BYTES, TokenRing


@pytest.fixture
def ring():
    r = TokenRing.create(HEADER_BYTES + 4 * 16)
    yield r
    r.close()


def test_segment_is_owner_only_with_an_unguessable_project_name(ring):
    path = shm_segments.SHM_DIR / ring.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ring.name.startswith(f"llmserve_{os.getpid()}_")
    assert len(ring.name.rsplit("_", 1)[1]) == 32  # 128 random bits
    other = TokenRing.create(HEADER_BYTES + 64)
    assert other.name != ring.name
    other.close()


def test_write_read_wraps_around_and_refuses_when_full(ring):
    assert ring.capacity == 16
    a = ring.try_write(list(range(10)))
    assert a == 0
    assert ring.try_write(list(range(7))) is None  # 10 + 7 > 16: the caller falls back to inline
    assert ring.read_and_release(a, 10) == list(range(10))
    b = ring.try_write(list(range(100, 112)))  # slots 10..15 then 0..5
    assert b == 10
    assert ring.read(b, 12) == list(range(100, 112))
    ring.release(b, 12)
    assert ring.try_write(np.arange(16, dtype=np.int32)) == 22  # exactly full is fine
    assert ring.try_write([1]) is None


def test_out_of_order_release_frees_only_a_contiguous_prefix(ring):
    s1 = ring.try_write([1] * 4)
    s2 = ring.try_write([2] * 4)
    s3 = ring.try_write([3] * 4)
    ring.release(s2, 4)
    ring.release(s3, 4)
    assert ring.released == 0
    assert ring.try_write([9] * 5) is None
    ring.release(s1, 4)
    assert ring.released == 12
    assert ring.try_write([9] * 16) is not None


def test_reads_outside_the_live_region_are_rejected(ring):
    s = ring.try_write([5, 6, 7])
    with pytest.raises(ValueError):
        ring.read(s, 4)  # never written
    ring.release(s, 3)
    with pytest.raises(ValueError):
        ring.read(s, 3)  # already released


def test_another_process_reads_what_this_one_wrote_and_leaves_the_segment_alone(ring):
    start = ring.try_write([7, 8, 2**31 - 1, -1])
    code = (
        "import sys; from engine_svc.server.shm_ring import TokenRing\n"
        f"r = TokenRing.attach({ring.name!r}); print(r.read_and_release({start}, 4)); "
        "r.try_write([42]); r.close()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([7, 8, 2**31 - 1, -1])
    assert "leaked" not in out.stderr  # the attacher's resource tracker must not claim the segment
    assert ring.released == 4
    assert (shm_segments.SHM_DIR / ring.name).exists()  # still ours after the other process exited
    assert ring.read(4, 1) == [42]


def test_close_unlinks_only_for_the_owner():
    r = TokenRing.create(HEADER_BYTES + 64)
    view = TokenRing.attach(r.name)
    view.close()
    assert (shm_segments.SHM_DIR / r.name).exists()
    r.close()
    r.close()
    assert not (shm_segments.SHM_DIR / r.name).exists()


def test_attach_refuses_foreign_names():
    with pytest.raises(ValueError):
        TokenRing.attach("psm_12345")


def test_sweep_removes_segments_of_dead_creators_only(ring):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = f"llmserve_{dead}_{'ab' * 16}"
    foreign = f"otherapp_{dead}_{'cd' * 16}"
    for name in (stale, foreign):
        fd = os.open(shm_segments.SHM_DIR / name, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
    try:
        removed = shm_segments.sweep_stale_segments()
        assert stale in removed
        assert not (shm_segments.SHM_DIR / stale).exists()
        assert (shm_segments.SHM_DIR / foreign).exists()
        assert (shm_segments.SHM_DIR / ring.name).exists()  # our live segment is kept
    finally:
        for name in (stale, foreign):
            (shm_segments.SHM_DIR / name).unlink(missing_ok=True)
