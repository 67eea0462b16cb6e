"""The service benchmarks run end to end in their --quick form and write well-formed results.

benchmarks.serving --quick is checked in tests/test_bench_quick.py::test_run_all_writes_report_with_plots,
which runs it through run_all (one run of it per suite, not two)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


def run_bench(name: str, out) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout
    return json.loads(out.read_text())


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow
def test_transports_quick(tmp_path):
    r = run_bench("transports", tmp_path / "transports.json")
    assert r["shm"]["transport_reported"] == "shared-memory" and r["grpc"]["transport_reported"] == "grpc"
    assert r["shm"]["errors"] == 0 and r["grpc"]["errors"] == 0
    assert finite(r["throughput_ratio_shm_over_grpc"]) and r["faster"] in ("shm", "grpc")


@pytest.mark.slow
def test_tokenizer_workers_quick(tmp_path):
    r = run_bench("tokenizer_workers", tmp_path / "tokenizer_workers.json")
    for key in ("with_workers", "without_workers"):
        assert r[key]["errors"] == 0 and r[key]["long_prompts_tokenized"] >= 1
        assert finite(r[key]["itl_p99_ms"])
