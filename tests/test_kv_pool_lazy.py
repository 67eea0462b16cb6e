"""The CPU KV pool: lazily backed (resident only as written, never-written slots read 0.0), sized by
default from the memory available at start (engine_svc/kv_budget.py), freed blocks that hold nothing
reusable allocated first (engine_svc/block_pool.py)."""

from __future__ import annotations

import logging

import pytest
import torch

import engine_svc.engine as engine_module
from engine_svc import kv_budget
from engine_svc.block_pool import BlockPool
from engine_svc.lazy_memory import lazy_zeros, resident_bytes, span
from engine_svc.model_setup import allocate_kv_caches, kv_resident_bytes
from engine_svc.sampling_params import SamplingParams
from kernels.cpu import native_attention
from kernels.cpu import paged_attention as torch_path
from kernels.reference.kv_write import write_kv
from kernels.reference.paged_attention import paged_attention as reference_attention
from tests.engine_helpers import make_engine, run_to_completion

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_a_large_pool_is_not_resident_at_start(tiny_llama):
    """An engine with a 1 GiB pool holds about what one with 16 blocks holds (torch.zeros wrote every
    page at start: 1 GiB more)."""
    small_before = _rss()
    small = make_engine(tiny_llama, num_kv_blocks=16)
    small_grew = _rss() - small_before
    before = _rss()
    # 128-token blocks: 16,384 of them, so the block pool's Python objects (~300 bytes a block) stay
    # small beside the 1 GiB of K/V.
    large = make_engine(tiny_llama, num_kv_blocks=None, kv_cache_memory=1 << 30, block_size=128)
    grew = _rss() - before
    pool = sum(c.numel() * c.element_size() for c in {id(c): c for c in large.runtime.kv_caches}.values())
    assert pool == 1 << 30
    assert kv_resident_bytes(large.runtime.kv_caches) == 0
    # The small engine's start may hand memory back (malloc_trim: RSS fell 78 MiB once on CI), so
    # its growth counts as at least 0; a resident pool would add 1 GiB.
    assert grew - max(small_grew, 0) < 16 * MiB, (grew >> 20, small_grew >> 20)
    del small


def test_the_pool_is_resident_as_written_and_one_mapping(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=512)
    caches = engine.runtime.kv_caches
    assert kv_resident_bytes(caches) == 0
    out = run_to_completion(
        engine, {"a": (list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=8))}
    )
    assert len(out[("a", 0)]) == 8
    written = kv_resident_bytes(caches)
    # 45 tokens: 3 blocks, each a 2 KiB K and V page part in each of 2 layers; at most a page apiece.
    assert 0 < written <= 3 * 2 * 2 * 4096, written
    for cache in caches:  # the blocks never used read 0.0, and reading them makes nothing resident
        assert float(cache[:, 8:].abs().max()) == 0.0
    assert kv_resident_bytes(caches) == written
    lo, hi = span(caches)
    assert hi - lo <= sum(c.numel() * c.element_size() for c in caches) + 4096  # one mapping, no gaps


def test_resident_bytes_counts_written_pages_only():
    pool = lazy_zeros((2, 64, 16, 2, 64), torch.float32)  # 8 KiB a block half
    where = span([pool])
    assert resident_bytes(*where) == 0
    assert float(pool.abs().max()) == 0.0  # reading maps the zero page: not resident
    assert resident_bytes(*where) == 0
    pool[0, 3] = 1.0
    pool[1, 60, 0] = 2.0  # half a block: one page
    assert resident_bytes(*where) == 3 * 4096
    assert float(pool.sum()) == 8192 / 4 + 2 * 128
    half = lazy_zeros((5,), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and float(half.sum()) == 0.0
    with pytest.raises(ValueError, match="crosses"):  # a part of a mapping: its pages cannot be told apart
        resident_bytes(*span([pool[1]]))


@pytest.mark.parametrize("path", ["torch", "native", "reference"])
def test_kernels_over_a_lazy_pool_equal_a_zeroed_cache_and_leave_it_unresident(tiny_llama, path):
    """Decodes of unequal lengths in one call, their tables padded with never-written blocks: the
    output is finite and bit-equal to the same K/V in a torch.zeros cache, and the call makes no page
    of the pool resident (the written ones were already)."""
    engine = make_engine(tiny_llama, num_kv_blocks=64)
    spec = engine.spec
    from engine_svc.parallel.shard import Shard

    caches = allocate_kv_caches(spec, Shard(), 64, 16, torch.float32, torch.device("cpu"))
    lazy = caches[0]
    dense = torch.zeros_like(lazy)
    gen = torch.Generator().manual_seed(3)
    hk, d = lazy.shape[3], lazy.shape[4]
    lens = [37, 5, 20]
    tables = torch.tensor([[7, 9, 11], [40, 0, 0], [20, 21, 0]], dtype=torch.int32)
    for row, n in enumerate(lens):
        slots = torch.tensor([int(tables[row, t // 16]) * 16 + t % 16 for t in range(n)])
        k, v = torch.randn((n, hk, d), generator=gen), torch.randn((n, hk, d), generator=gen)
        for cache in (lazy, dense):
            write_kv(k, v, cache[0], cache[1], slots)
    written = kv_resident_bytes(caches)
    assert 0 < written <= 7 * 2 * 4096  # 7 blocks written, a K and a V page part each
    q = torch.randn((3, spec.num_heads, d), generator=gen)
    args = (tables, torch.tensor(lens, dtype=torch.int32), torch.arange(4, dtype=torch.int32), d**-0.5)
    run = {
        "torch": torch_path.paged_attention,
        "native": native_attention.paged_attention,
        "reference": reference_attention,
    }[path]
    if path == "native" and not native_attention.enabled():
        pytest.skip("no native attention library on this machine")
    got = run(q, lazy[0], lazy[1], *args)
    assert torch.isfinite(got).all()
    assert torch.equal(got, run(q, dense[0], dense[1], *args))
    assert kv_resident_bytes(caches) == written


def test_the_default_budget_is_half_the_memory_available():
    assert kv_budget.cpu_default_kv_bytes(20 << 30, "MemAvailable") == (
        10 << 30,
        "50% of MemAvailable at start (20480 MiB)",
    )
    budget, how = kv_budget.cpu_default_kv_bytes(20 << 30, "MemAvailable", ranks=2)
    assert budget == 5 << 30 and "shared by 2 tensor-parallel ranks" in how
    assert kv_budget.cpu_default_kv_bytes(None)[0] == kv_budget.CPU_FALLBACK_KV_BYTES
    budget, how = kv_budget.cpu_default_kv_bytes(24 << 30, "MemAvailable", ranks=2, replicas=3)
    assert budget == 2 << 30 and how.endswith("shared by 2 tensor-parallel ranks x 3 replicas"), how


def test_replicas_started_together_share_the_budget(monkeypatch):
    """``llmserve serve --replicas K`` tells each engine it starts that K share the host's memory."""
    import argparse

    from gateway import launcher

    seen = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, **kw: seen.append(kw.get("env")))
    args = argparse.Namespace(model="m", log_level="info", replicas=3)
    monkeypatch.setattr(launcher, "engine_options_argv", lambda a: [])
    launcher.start_engine(args, "/tmp/x.sock")
    assert seen[-1][kv_budget.KV_SHARE_ENV] == "3"
    args.replicas = 1
    launcher.start_engine(args, "/tmp/x.sock")
    assert seen[-1] is None  # the launcher's own environment, unchanged
    monkeypatch.setenv(kv_budget.KV_SHARE_ENV, "3")
    assert kv_budget.replicas_sharing() == 3
    monkeypatch.setenv(kv_budget.KV_SHARE_ENV, "x")
    assert kv_budget.replicas_sharing() == 1


def test_a_cgroup_limit_bounds_the_memory_available(tmp_path, monkeypatch):
    root = tmp_path / "cg"
    leaf = root / "a" / "b"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(str(100 * MiB))
    (root / "a" / "memory.max").write_text(str(3 << 30))  # the parent's limit binds
    (root / "a" / "memory.current").write_text(str(1 << 30))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert kv_budget._cgroup_room(str(proc), str(root)) == 2 << 30
    (root / "a" / "memory.max").write_text("max\n")
    assert kv_budget._cgroup_room(str(proc), str(root)) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "x").mkdir(parents=True)
    (v1 / "memory" / "x" / "memory.limit_in_bytes").write_text(str(4 << 30))
    (v1 / "memory" / "x" / "memory.usage_in_bytes").write_text(str(1 << 30))
    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/x\n")
    assert kv_budget._cgroup_room(str(proc), str(v1)) == 3 << 30
    (v1 / "memory" / "x" / "memory.limit_in_bytes").write_text(str(0x7FFFFFFFFFFFF000))  # v1's "none"
    assert kv_budget._cgroup_room(str(proc), str(v1)) is None
    monkeypatch.setattr(kv_budget, "_cgroup_room", lambda: 2 << 30)
    monkeypatch.setattr(kv_budget, "_meminfo_available", lambda: 8 << 30)
    assert kv_budget.available_memory() == (2 << 30, "the room under this process's cgroup memory limit")
    monkeypatch.setattr(kv_budget, "_cgroup_room", lambda: None)
    assert kv_budget.available_memory() == (8 << 30, "MemAvailable")


def test_the_engine_sizes_its_pool_from_the_budget_and_says_so(tiny_llama, monkeypatch, caplog):
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # k and v, 2 layers, 2 KV heads, head dim 16, fp32, 16 tokens
    monkeypatch.setattr(engine_module, "available_memory", lambda: (64 * MiB, "MemAvailable"))
    with caplog.at_level(logging.INFO, logger="engine_svc.engine"):
        engine = make_engine(tiny_llama, num_kv_blocks=None)
    assert engine.kv.pool.num_blocks == 32 * MiB // per_block
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:"))
    assert f"{32 * MiB // per_block} blocks of 16 tokens" in line
    assert "a budget of 32 MiB: 50% of MemAvailable at start (64 MiB)" in line, line
    assert "lazily backed" in line
    # More than enough memory: the pool holds max_num_seqs whole contexts, no more.
    monkeypatch.setattr(engine_module, "available_memory", lambda: (64 << 30, "MemAvailable"))
    engine = make_engine(tiny_llama, num_kv_blocks=None, max_num_seqs=4)
    per_seq = -(-engine.max_model_len // 16)
    assert engine.kv.pool.num_blocks == 4 * per_seq
    # kv_cache_memory and num_kv_blocks still decide where given.
    assert (
        make_engine(tiny_llama, num_kv_blocks=None, kv_cache_memory=per_block * 10).kv.pool.num_blocks == 10
    )
    assert make_engine(tiny_llama, num_kv_blocks=7).kv.pool.num_blocks == 7


def test_a_freed_block_without_a_hash_is_allocated_before_unused_and_cached_ones():
    pool = BlockPool(8)
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    pool.register(first[0], block_hash=123, token_ids=(1, 2))
    pool.release(list(reversed(first)))  # as KVCacheManager.free does, tail first
    # Blocks 1 and 2 held nothing reusable: they come back first; block 0 (a cache entry) goes last.
    assert sorted(pool.allocate(2)) == [1, 2]
    assert pool.allocate(5) == [3, 4, 5, 6, 7]
    assert pool.lookup(123, (1, 2)) == 0  # still cached: evicted only now
    assert pool.allocate(1) == [0] and pool.lookup(123, (1, 2)) is None


def test_without_prefix_caching_requests_one_after_another_reuse_the_same_blocks(tiny_llama):
    """The pool is written only as far as the work in flight needs: sequential requests with no cache
    entries to keep never reach the never-used blocks (FIFO reuse walked the whole pool)."""
    engine = make_engine(tiny_llama, num_kv_blocks=256, enable_prefix_caching=False)
    seen: set[int] = set()
    original = engine.kv.pool.allocate

    def allocate(count):
        got = original(count)
        seen.update(got or ())
        return got

    engine.kv.pool.allocate = allocate
    for i in range(12):
        run_to_completion(
            engine, {f"r{i}": (list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=20))}
        )
    assert len(seen) <= 4, sorted(seen)  # 57 tokens: 4 blocks
