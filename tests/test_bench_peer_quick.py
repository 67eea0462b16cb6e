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
