"""The shared-memory token ring and its segments: layout, wrap-around, back-pressure, ownership."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from engine_svc.rpc import shm_segments
from engine_svc.rpc.shm_ring import HEADER_BYTES, TokenRing


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
        "import sys; from engine_svc.rpc.shm_ring import TokenRing\n"
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


def _rss_shmem_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssShmem in /proc/self/status")


def test_a_segment_is_resident_in_every_process_that_maps_it_from_the_start():
    # Else the resident set creeps up as the write position sweeps through untouched pages: 20 MiB
    # of rings read as a slow leak over a day of traffic.
    size = 4 << 20
    before = _rss_shmem_bytes()
    r = TokenRing.create(size)
    try:
        assert _rss_shmem_bytes() - before >= size - 4096
        view = TokenRing.attach(r.name)
        assert _rss_shmem_bytes() - before >= 2 * size - 8192  # a second mapping, resident too
        view.close()
    finally:
        r.close()


def _dev_shm_total_bytes() -> int:
    st = os.statvfs(shm_segments.SHM_DIR)
    return st.f_blocks * st.f_frsize


def test_a_segment_larger_than_dev_shm_is_refused_at_creation_and_leaves_nothing():
    # A tmpfs hands out pages on first touch: without the reservation this segment would be made
    # and the process would die of SIGBUS later, when a write reached a page the tmpfs cannot give.
    before = shm_segments.list_segments()
    with pytest.raises(OSError, match=r"/dev/shm has no room for a \d+-byte segment.*--transport grpc"):
        TokenRing.create(2 * _dev_shm_total_bytes())
    assert shm_segments.list_segments() == before


def test_an_engine_session_without_room_for_its_rings_carries_ids_in_messages():
    from engine_svc.server.engine_loop import EngineLoop

    loop = EngineLoop(engine=None)  # opening a session does not touch the engine
    before = shm_segments.list_segments()
    s = loop.open_session("gw", 2 * _dev_shm_total_bytes(), 1 << 20)
    assert s.prompt_ring is None and s.output_ring is None
    assert shm_segments.list_segments() == before
    s = loop.open_session("gw", 1 << 20, 2 * _dev_shm_total_bytes())  # the second ring fails
    assert s.prompt_ring is None and s.output_ring is None
    assert shm_segments.list_segments() == before  # the first ring was closed and unlinked
