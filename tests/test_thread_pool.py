"""The native kernels' thread pool (kernels/cpu/native/thread_pool.c): every item of a loop runs
exactly once, whichever threads take it; a loop completes with its pool threads asleep, with a
second caller at the same time (that one runs alone), from inside an item, and in a fork()ed child;
and the kernels' libraries bind to this one pool.

The items here are Python callbacks (ctypes): each takes the GIL, so they test the claiming, not
speed. The kernels' bit-equality at every thread count is tested with each kernel."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import pytest

from kernels.cpu import native_build

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler: no native kernels")

RANGE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


@pytest.fixture(scope="module")
def pool():
    lib = native_build.load(native_build.POOL, "generic")
    lib.llmserve_pool_for.argtypes = [
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_int64,
        RANGE_FN,
        ctypes.c_void_p,
    ]
    lib.llmserve_pool_for.restype = None
    lib.llmserve_pool_for_guided.argtypes = lib.llmserve_pool_for.argtypes
    lib.llmserve_pool_for_guided.restype = None
    lib.llmserve_pool_threads.restype = ctypes.c_int32
    return lib


def run_loop(pool, threads: int, n: int, grain: int, on_item=None) -> tuple[list[int], set[int]]:
    """The loop's per-item run counts, and the thread ids that ran some."""
    counts = [0] * n
    who: set[int] = set()

    def fn(_ctx, begin, end):
        assert 0 <= begin < end <= n  # (run alone, the caller takes the whole range at once)
        who.add(threading.get_ident())
        for i in range(begin, end):
            counts[i] += 1
            if on_item:
                on_item(i)

    cb = RANGE_FN(fn)
    pool.llmserve_pool_for(threads, n, grain, cb, None)
    return counts, who


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "grain"), [(1, 1), (2, 1), (7, 3), (100, 1), (1000, 7), (257, 256)])
def test_every_item_runs_exactly_once(pool, threads, n, grain):
    for _ in range(5):
        counts, _ = run_loop(pool, threads, n, grain)
        assert counts == [1] * n


def guided_schedule(threads: int, n: int, min_grain: int, cap: int = 256) -> list[tuple[int, int]]:
    """The documented claims of a guided loop, written from its statement: each takes
    ceil(left / (2 * threads)) items, at least min_grain; the table's last claim takes the rest."""
    out, at = [], 0
    while at < n:
        size = max(min_grain, -(-(n - at) // (2 * threads)))
        if len(out) == cap - 1:
            size = n - at
        size = min(size, n - at)
        out.append((at, at + size))
        at += size
    return out


@pytest.mark.parametrize(
    ("threads", "n", "min_grain"),
    [(2, 2, 1), (2, 20, 1), (2, 128, 1), (3, 1000, 7), (8, 4747, 1), (64, 5000, 1)],
)
def test_guided_claims_shrink_and_cover_every_item_once(pool, threads, n, min_grain):
    """A guided loop (a GEMV's panels) claims the documented shrinking ranges, each once, so every
    item runs exactly once; the last case needs more claims than the pool's table holds."""
    ranges: list[tuple[int, int]] = []
    counts = [0] * n

    def fn(_ctx, begin, end):
        ranges.append((begin, end))
        for i in range(begin, end):
            counts[i] += 1

    cb = RANGE_FN(fn)
    for _ in range(3):
        ranges.clear()
        counts[:] = [0] * n
        pool.llmserve_pool_for_guided(threads, n, min_grain, cb, None)
        assert counts == [1] * n
        assert sorted(ranges) == guided_schedule(threads, n, min_grain)


def test_pool_threads_take_items_and_are_started_once(pool):
    """With an item that waits until another thread has run one, a second thread must take part
    (the caller alone would wait forever: the test's own bound is only against a hang)."""
    seen = threading.Event()
    caller = threading.get_ident()

    def on_item(i):
        if threading.get_ident() != caller:
            seen.set()
        elif i == 0:
            assert seen.wait(60), "no pool thread took an item"

    counts, who = run_loop(pool, 2, 64, 1, on_item)
    assert counts == [1] * 64 and who - {caller}  # (on a busy machine the caller may take none)
    started = pool.llmserve_pool_threads()
    assert started >= 1
    run_loop(pool, 2, 64, 1)
    assert pool.llmserve_pool_threads() == started


def test_a_second_caller_and_a_nested_loop_run_alone_and_complete(pool):
    """While one loop runs, a loop started from another Python thread or from inside an item runs
    on its caller alone: both complete, every item once."""
    inside = threading.Event()
    release = threading.Event()
    nested: list = []

    def on_item(i):
        if i == 0:
            nested.append(run_loop(pool, 4, 50, 1))  # from inside an item
            inside.set()
            assert release.wait(60)

    t = threading.Thread(target=lambda: nested.append(("outer", run_loop(pool, 2, 20, 1, on_item))))
    t.start()
    assert inside.wait(60)
    counts, who = run_loop(pool, 4, 30, 1)  # another caller while the first loop holds the pool
    assert counts == [1] * 30 and who == {threading.get_ident()}
    release.set()
    t.join(60)
    (inner_counts, inner_who), (_, (outer_counts, _)) = nested
    assert inner_counts == [1] * 50 and len(inner_who) == 1
    assert outer_counts == [1] * 20


def test_loops_complete_after_fork(pool):
    run_loop(pool, 2, 100, 1)  # the parent's pool threads exist
    pid = os.fork()
    if pid == 0:  # the child: its pool threads did not come along; loops still complete
        ok = True
        try:
            for threads in (2, 3):
                counts, _ = run_loop(pool, threads, 200, 3)
                ok = ok and counts == [1] * 200
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_kernel_libraries_bind_to_the_pool():
    """A kernel's loop at two threads starts the one global pool's thread, for each library and
    instruction set (without the binding every loop would run on one thread, and no test of bits
    would notice). In a fresh process: the pool's threads are counted from zero."""
    code = """
import ctypes, sys, torch
from kernels.cpu import native_build, native_elementwise, quant_gemm
from kernels.cpu import native_build as nb
pool = nb.load(nb.POOL, "generic")
assert pool.llmserve_pool_threads() == 0
lib = nb.load("elementwise", sys.argv[1])
x = torch.randn(64, 1024)
w = torch.ones(1024)
out = torch.empty_like(x)
lib.llmserve_rms_norm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
lib.llmserve_rms_norm_f32(x.data_ptr(), None, w.data_ptr(), 1e-6, 64, 1024, out.data_ptr(), None, 2)
print(pool.llmserve_pool_threads())
"""
    for isa in native_build.supported_isas():
        r = subprocess.run([sys.executable, "-c", code, isa], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["1"], (isa, r.stdout, r.stderr)
