"""How many threads the engine process computes with (torch's and the native kernels' pool).

Every CPU the process may use: the native kernels' pool (kernels/cpu/native/thread_pool.c) never
waits for a thread that has no core, so the gateway, the tokenizer workers and this process's gRPC
threads, which wake for every streamed token, take a core from the step only while they run
(docs/design/engine-threads.md has the measurements on the real models). The CPUs counted are
those this process may run on and, in a container, those its CPU limit pays for: the affinity mask
still lists every core of the node when a pod is limited to 2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def torch_threads(requested: int | None, cgroup_root: Path = CGROUP_ROOT) -> int:
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--torch-threads must be at least 1, got {requested}")
        return requested
    return usable_cpus(cgroup_root)


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(cgroup_root)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time per period that this process's cgroup may use; None when unlimited or
    unknown. cgroup v2 (``cpu.max``: "QUOTA PERIOD" or "max PERIOD") is looked up at this process's
    own cgroup and at the root (a container with its own cgroup namespace sees itself there);
    cgroup v1 at its ``cpu`` hierarchy."""
    for path in _v2_files(root):
        try:
            quota, period = path.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    for name in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / name / "cpu.cfs_quota_us").read_text())
            period = int((root / name / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 else quota / period
    return None


def _v2_files(root: Path) -> list[Path]:
    files = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                files.append(root / line[3:].lstrip("/") / "cpu.max")
    except OSError:
        pass
    files.append(root / "cpu.max")
    return files
