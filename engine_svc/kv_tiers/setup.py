"""The engine's tiers, sized from its config and device (the defaults: config.py)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from engine_svc.kv_tiers.fingerprint import kv_fingerprint
from engine_svc.kv_tiers.store import TieredStore
from engine_svc.kv_tiers.transfer import block_nbytes, distinct_caches

log = logging.getLogger(__name__)

GPU_HOST_TIER_BYTES = 4 << 30  # at most a quarter of the host's memory
# The disk tier when its size is not given (EngineConfig.kv_disk_bytes None: `llmserve serve`'s
# default): 4 GiB, and never more than a quarter of the space its filesystem has free at start (the
# tier's own files counted as free), so that it cannot fill a disk nobody asked it to.
DISK_TIER_BYTES = 4 << 30
DISK_FREE_SHARE = 4


def default_disk_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve"
    )
    return Path(root) / "kv"


def host_tier_bytes(config, device: torch.device) -> int:
    if config.kv_offload_bytes is not None:
        return config.kv_offload_bytes
    if device.type != "cuda":
        return 0  # the pool is host memory: a second copy there buys nothing the pool could not hold
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 4 * GPU_HOST_TIER_BYTES
    return min(GPU_HOST_TIER_BYTES, ram // 4)


def free_bytes(path: Path) -> int:
    """Free space of the filesystem that holds (or will hold) ``path``."""
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return 0


def build_tiers(config, device, kv_caches, windows, dtype, weights_dtype, kernels: str, why_not: str | None):
    """The ``TieredStore`` under the pool, or None (both tiers off, prefix caching off, or
    ``why_not``: a reason the engine cannot use them)."""
    host, disk = host_tier_bytes(config, device), config.kv_disk_bytes
    sized = disk is not None  # None: the default size, bounded by the free space below
    if not sized:
        disk = DISK_TIER_BYTES
    if not host and not disk or not config.enable_prefix_caching:
        return None
    if why_not:  # asked for: a warning; the server's default tier: a note
        (log.warning if sized or host else log.info)("KV tiers off: %s", why_not)
        return None
    isa = ""
    if device.type == "cpu":
        from kernels.cpu import native_build

        isa = native_build.chosen_isa()
    caches = distinct_caches(kv_caches)
    fp = kv_fingerprint(
        config, [c[:, 0].shape for c in caches], windows, dtype, device, kernels, isa, weights_dtype
    )
    disk_dir = Path(config.kv_disk_dir or default_disk_dir())
    try:
        store = TieredStore(host, disk, disk_dir, fp)
    except OSError as e:  # the directory cannot be made: the engine runs, its disk tier off
        log.warning("KV disk tier off: cannot use %s: %s", disk_dir, e)
        store = TieredStore(host, 0, None, fp)
        if not store.enabled:
            return None
    if store.disk is not None and not sized:
        room = (free_bytes(disk_dir) + store.disk.stats.bytes) // DISK_FREE_SHARE
        store.disk.bound(min(DISK_TIER_BYTES, room))
    per_block = block_nbytes(kv_caches)
    log.info(
        "KV tiers: host %d MiB, disk %d MiB%s (%d KiB a block, fingerprint %s)",
        host >> 20,
        store.disk.stats.capacity_bytes >> 20 if store.disk is not None else 0,
        f" under {store.disk.dir}" if store.disk is not None else "",
        per_block >> 10,
        fp.hex()[:12],
    )
    return store
