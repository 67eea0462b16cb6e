"""Where a figure was measured: the commit, the CPU (model and the instruction-set flags the kernels
choose by) and the software, so that a report says what it is a report of."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The flags that decide which kernels run (kernels/cpu/features.py and the native builds); the full
# /proc/cpuinfo list is a hundred entries that say nothing about a figure.
RELEVANT_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "asimd",
)


def cpu_model_and_flags(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """The first processor's model name and its relevant flags, from /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or "unknown", []
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.processor() or "unknown", [f for f in RELEVANT_FLAGS if f in flags]


def git_commit() -> str:
    """The short commit hash, with ``-dirty`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def machine_info() -> dict:
    """The machine as a benchmark result records it."""
    import torch

    model, flags = cpu_model_and_flags()
    return dict(
        cpu_model=model,
        cpu_flags=flags,
        cpus=os.cpu_count(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
    )


def describe(machine: dict) -> str:
    """One line: ``AMD EPYC (avx2, avx512f, ...), 2 CPUs, Linux-..., Python 3.11.7, torch 2.13.0``."""
    flags = ", ".join(machine.get("cpu_flags") or []) or "flags not recorded"
    return (
        f"{machine.get('cpu_model', 'CPU model not recorded')} ({flags}), {machine.get('cpus')} CPUs, "
        f"{machine.get('platform')}, Python {machine.get('python')}, torch {machine.get('torch')}"
    )
