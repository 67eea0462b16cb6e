"""The engine process's threads: every CPU it may use by default (its affinity and its container's
CPU limit), an explicit count honoured, a nonsense count refused before anything loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from engine_svc.server.cpus import torch_threads, usable_cpus
from tests.service_process import ServiceProcess


def test_default_is_every_usable_cpu(monkeypatch, tmp_path):
    no_limit = tmp_path / "no-cgroup"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert torch_threads(None, no_limit) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert torch_threads(None, no_limit) == 1
    assert torch_threads(3, no_limit) == 3


@pytest.mark.parametrize(
    "files, cpus",
    [
        ({"cpu.max": "250000 100000\n"}, 3),  # cgroup v2, a limit of 2.5 CPUs
        ({"cpu.max": "max 100000\n"}, 64),  # v2, unlimited
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 64),  # v1, unlimited
        ({"cpu.max": "6400000 100000\n"}, 64),  # a limit above the cores: the cores
    ],
)
def test_a_container_cpu_limit_counts_not_the_nodes_cores(monkeypatch, tmp_path, files, cpus):
    # The affinity mask lists all 64 cores of the node; the pod's limit is what it may use.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert usable_cpus(tmp_path) == cpus
    assert torch_threads(None, tmp_path) == cpus


def test_a_count_below_one_is_refused_with_the_flag_named(tmp_path):
    with pytest.raises(ValueError, match="--torch-threads must be at least 1, got 0"):
        torch_threads(0)
    out = subprocess.run(
        [sys.executable, "-m", "engine_svc.server", "--model", str(tmp_path), "--torch-threads", "-2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--torch-threads must be at least 1, got -2" in out.stderr


def test_the_launcher_passes_the_count_on_and_the_engine_reports_what_it_runs(tiny_llama):
    expected = usable_cpus()
    with ServiceProcess(tiny_llama, "--tokenizer-workers", "0") as sp:
        found = re.findall(r"engine ready on .* torch threads (\d+)", sp.log_tail(10**6))
        assert found == [str(expected)], sp.log_tail()
    with ServiceProcess(tiny_llama, "--tokenizer-workers", "0", "--torch-threads", "3") as sp:
        found = re.findall(r"engine ready on .* torch threads (\d+)", sp.log_tail(10**6))
        assert found == ["3"], sp.log_tail()
