"""benchmarks/peer.py --quick: our side of the side-by-side runs and writes its figures, and a peer
that did not run is reported as missing, never as met (here it never runs: --quick leaves vLLM out)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.report import target_table, verdict

ROOT = Path(__file__).resolve().parents[1]


def test_peer_quick_reports_a_missing_peer_as_missing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peer", "--quick", "--no-serving", "--results-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "peer.json").read_text())
    assert doc["benchmark"] == "peer" and doc["quick"] is True
    f = doc["figures"]
    for side in ("ours_default", "ours_matched"):
        for name in ("random", "long_tail", "shared_prefix"):
            assert f[side][name]["output_tokens"] == f["workloads"][name]["output_tokens"] > 0
            assert f[side][name]["wall_s"] > 0
    assert f["ours_matched"]["_meta"]["torch_threads"] == 1
    assert "vllm" not in f
    assert len(doc["targets"]) == 9  # three workloads: at defaults, at matched threads (wall, per CPU-second)
    for t in doc["targets"]:
        assert t["value"] is None and t["met"] is None and t["note"].startswith("MISSING")
        assert verdict(t) == "**MISSING**"
    table = "\n".join(target_table({"benchmarks": {"peer": {"result": doc, "status": "ok"}}}))
    assert "**MISSING**" in table and " met " not in table


def test_verdicts():
    judged = dict(name="x", value=1.5, op=">=", target=1.3, unit="x", met=True, note="")
    assert verdict(judged) == "met"
    assert verdict(judged | dict(value=1.0, met=False)) == "**MISSED**"
    assert verdict(judged | dict(value=None, met=None)) == "**MISSING**"
    assert verdict(judged | dict(op=None, target=None, met=None)) == ""


def test_real_peer_binds_vllm_to_every_core_we_may_use():
    """vLLM-CPU's own default (``auto``) keeps one core for its scheduler on x86: on a 2-core machine
    its worker computed on one thread against our two in ``real_peer``, whose figures are two
    threads each. Its peer binds vLLM's threads to every CPU this process may use and records the
    cores vLLM reports; ``peer`` keeps vLLM's default (and compares at matched threads)."""
    import inspect
    import os

    from benchmarks import real_peer
    from benchmarks.vllm_peer import all_cpus, omp_cores, vllm_env

    cpus = sorted(os.sched_getaffinity(0))
    env = vllm_env(all_cpus())
    assert [int(c) for c in env["VLLM_CPU_OMP_THREADS_BIND"].split(",")] == cpus
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "OMP_NUM_THREADS" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env() or os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    assert "threads_bind=all_cpus()" in inspect.getsource(real_peer)
    log = (
        "(EngineCore pid=30698) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]\n"
        "(EngineCore pid=30698) INFO [ompmultiprocessing.py:185] \treserved_cpus=[]"
    )
    assert omp_cores(log) == [0, 1] and omp_cores("no binding logged") is None
