"""The CPU KV pool's default budget: a share of the memory available when the engine starts.

vLLM-CPU's rule (``cpu_worker.determine_available_memory``): ``gpu_memory_utilization`` (0.9) of the
NUMA node's total memory, less what the worker process already holds, refused when that is more
than the node has available. It takes the machine. Ours takes ``CPU_KV_MEMORY_FRACTION`` (half) of
what is available at start, measured after the weights are loaded (so they are not counted twice):

- the other half stays for everything else on the machine: other processes, the page cache, the
  engine's own step buffers and heap growth, a second engine or replica started beside this one;
- available is ``MemAvailable`` (``/proc/meminfo``: free memory plus what the kernel can reclaim),
  and within a cgroup with a memory limit (a container) the room left under that limit, the smaller;
- tensor-parallel ranks on one host share it, and so do the engines of ``llmserve serve --replicas K``
  (each takes its part; the launcher tells them K through ``LLMSERVE_KV_SHARE``), since engines
  started together all see the same memory available;
- the pool is lazily backed (``lazy_memory.py``): nothing of it is resident at start, and the
  process's RSS grows towards the budget only as the cache fills (a long-running server with prefix
  caching keeps freed blocks as cache entries, so over time it does fill).

``kv_cache_memory`` / ``num_kv_blocks`` (``--num-kv-blocks``, ``--kv-cache-memory``) override it, and
``min(enough for max_num_seqs whole contexts, budget)`` keeps a pool no larger than can be used.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_KV_MEMORY_FRACTION = 0.5
# Set by the launcher in each engine it starts: the engines that share this host's memory.
KV_SHARE_ENV = "LLMSERVE_KV_SHARE"
# Where neither /proc/meminfo nor a cgroup answers (not Linux): the old fixed default.
CPU_FALLBACK_KV_BYTES = 1 << 30


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroup and its ancestors
    (cgroup v2 ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` -
    ``memory.usage_in_bytes``); None without a limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    room = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2 unified hierarchy
            base, limit_name, usage_name = Path(root), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base = Path(root) / "memory"
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        d = base / rel.lstrip("/")
        while True:
            limit, usage = _read_int(d / limit_name), _read_int(d / usage_name)
            # v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages): ignore limits past 2^60.
            if limit is not None and usage is not None and limit < 1 << 60:
                left = max(0, limit - usage)
                room = left if room is None else min(room, left)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return room


def available_memory() -> tuple[int | None, str]:
    """The memory available to this process now, and what the figure is."""
    avail, room = _meminfo_available(), _cgroup_room()
    if room is not None and (avail is None or room < avail):
        return room, "the room under this process's cgroup memory limit"
    return avail, "MemAvailable"


def replicas_sharing() -> int:
    """How many engine replicas started together share this host's memory: ``llmserve serve
    --replicas K`` tells each engine it starts through ``KV_SHARE_ENV`` (1 when unset)."""
    try:
        return max(1, int(os.environ.get(KV_SHARE_ENV, "1")))
    except ValueError:
        return 1


def cpu_default_kv_bytes(
    available: int | None, what: str = "the memory available", ranks: int = 1, replicas: int = 1
) -> tuple[int, str]:
    """The default budget of one rank's CPU KV pool from ``available`` bytes (None: unknown; ``what``
    names the figure), split between ``ranks`` tensor-parallel ranks and ``replicas`` engines, and a
    phrase that says how it was derived."""
    ways = ranks * replicas
    if available is None:
        fallback = f"the fixed fallback {CPU_FALLBACK_KV_BYTES >> 20} MiB (no memory figure)"
        return CPU_FALLBACK_KV_BYTES // ways, fallback
    budget = int(available * CPU_KV_MEMORY_FRACTION) // ways
    parts = [f"{n} {name}" for n, name in ((ranks, "tensor-parallel ranks"), (replicas, "replicas")) if n > 1]
    shared = f", shared by {' x '.join(parts)}" if parts else ""
    return budget, f"{CPU_KV_MEMORY_FRACTION:.0%} of {what} at start ({available >> 20} MiB){shared}"
