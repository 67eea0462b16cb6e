"""benchmarks/routing.py --quick: runs alone, writes a well-formed result, and its exact (round-
counted, machine-independent) hit rates put prefix affinity above round-robin."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_routing_quick(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.routing", "--quick", "--results-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in-process engines" in proc.stdout  # it says how the replicas were driven
    doc = json.loads((tmp_path / "routing.json").read_text())
    assert doc["benchmark"] == "routing" and doc["quick"] is True
    f = doc["figures"]
    w = doc["config"]["workload"]
    rr, aff = f["runs"]["round-robin"], f["runs"]["prefix-affinity"]
    for r in (rr, aff):
        assert sum(r["requests_per_replica"].values()) == w["num_requests"]
        assert 0 < r["hit_rate"] <= f["best_possible_hit_rate"] <= 1
        assert r["hit_tokens"] <= r["queried_tokens"]
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
    assert rr["requests_per_replica"] == {
        "replica-0": w["num_requests"] // 2,
        "replica-1": w["num_requests"] // 2,
    }
    assert aff["hit_rate"] > rr["hit_rate"]
    assert math.isclose(f["hit_rate_ratio"], aff["hit_rate"] / rr["hit_rate"])
    t, vs_best = doc["targets"]
    assert t["value"] == f["hit_rate_ratio"] and t["met"] == (t["value"] >= t["target"])
    # Against the best possible, over seeds, skewed popularity and more than 2 replicas.
    study = f["study"][f["affinity_over_best_worst_config"]]
    assert vs_best["value"] == study["affinity_over_best_median"]
    assert all(0 < r["prefix-affinity"] <= r["best_possible"] <= 1 for r in study["rows"])
    s = doc["series"]
    assert len(s["round-robin"]) == len(s["prefix-affinity"]) == len(s["kv_blocks"]) >= 2
