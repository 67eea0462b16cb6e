"""The engine's tiers, sized from its config and device (the defaults: config.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine_svc.kv_tiers.fingerprint import kv_fingerprint
from engine_svc.kv_tiers.store import TieredStore
from engine_svc.kv_tiers.transfer import block_nbytes, distinct_caches

log = logging.getLogger(__name__)

GPU_HOST_TIER_BYTES = 4 << 30  # at most a quarter of the host's memory


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


def build_tiers(config, device, kv_caches, windows, dtype, weights_dtype, kernels: str, why_not: str | None):
    """The ``TieredStore`` under the pool, or None (both tiers off, prefix caching off, or
    ``why_not``: a reason the engine cannot use them)."""
    host, disk = host_tier_bytes(config, device), config.kv_disk_bytes
    if not host and not disk or not config.enable_prefix_caching:
        return None
    if why_not:
        log.warning("KV tiers off: %s", why_not)
        return None
    isa = ""
    if device.type == "cpu":
        from kernels.cpu import native_build

        isa = native_build.chosen_isa()
    caches = distinct_caches(kv_caches)
    fp = kv_fingerprint(
        config, [c[:, 0].shape for c in caches], windows, dtype, device, kernels, isa, weights_dtype
    )
    disk_dir = config.kv_disk_dir or default_disk_dir()
    store = TieredStore(host, disk, disk_dir, fp)
    per_block = block_nbytes(kv_caches)
    log.info(
        "KV tiers: host %d MiB, disk %d MiB%s (%d KiB a block, fingerprint %s)",
        host >> 20,
        disk >> 20,
        f" under {store.disk.dir}" if store.disk is not None else "",
        per_block >> 10,
        fp.hex()[:12],
    )
    return store
