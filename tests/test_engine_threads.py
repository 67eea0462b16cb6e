"""The engine process's torch threads: one CPU left to the processes beside the model by default,
an explicit count honoured, a nonsense count refused before anything loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from engine_svc.server.main import torch_threads
from gateway.service_process import ServiceProcess


def test_default_leaves_one_cpu_and_never_goes_below_one(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert torch_threads(None) == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert torch_threads(None) == 1
    assert torch_threads(3) == 3


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
    expected = max(1, len(os.sched_getaffinity(0)) - 1)
    with ServiceProcess(tiny_llama, "--tokenizer-workers", "0") as sp:
        found = re.findall(r"engine ready on .* torch threads (\d+)", sp.log_tail(10**6))
        assert found == [str(expected)], sp.log_tail()
    with ServiceProcess(tiny_llama, "--tokenizer-workers", "0", "--torch-threads", "3") as sp:
        found = re.findall(r"engine ready on .* torch threads (\d+)", sp.log_tail(10**6))
        assert found == ["3"], sp.log_tail()
