"""``make bench``: every benchmark, each in its own process, then ``results/latest.json`` and
``results/REPORT.md`` with its plots.

A benchmark module that is absent (the service benchmarks live on another branch until merged) is
skipped with a printed note; one that fails is reported as failed, and the rest still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.machine import git_commit, machine_info
from benchmarks.registry import REGISTRY
from benchmarks.report import stored_run, write_report

TIMEOUT_S = 3600  # routing and transports take 20+ minutes on a loaded 2-core machine


def run_one(name: str, style: str, results_dir: Path, quick: bool, threads: int) -> dict:
    cmd = [sys.executable, "-m", f"benchmarks.{name}"]
    cmd += (
        ["--results-dir", str(results_dir)]
        if style == "results-dir"
        else ["--out", str(results_dir / f"{name}.json")]
    )
    if quick:
        cmd.append("--quick")
    env = dict(
        os.environ,
        LLMSERVE_BENCH_THREADS=str(threads),
        LLMSERVE_BENCH_RESULTS=str(results_dir),
        TOKENIZERS_PARALLELISM="false",
    )
    path = results_dir / f"{name}.json"
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, env=env, timeout=TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    elapsed = time.perf_counter() - t0
    fresh = path.exists() and path.stat().st_mtime >= time.time() - elapsed - 1
    status = "ok" if rc == 0 and fresh else f"failed (exit {rc}{'' if fresh else ', no result file'})"
    doc = json.loads(path.read_text()) if rc == 0 and fresh else None
    return dict(status=status, elapsed_s=elapsed, result=doc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="every benchmark in its --quick mode")
    p.add_argument("--only", nargs="*", help="run these benchmarks only")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    p.add_argument("--threads", type=int, default=int(os.environ.get("LLMSERVE_BENCH_THREADS", "1")))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild latest.json and REPORT.md from the result files already there",
    )
    args = p.parse_args()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    runs: dict[str, dict] = {}
    for name, style in REGISTRY:
        if args.only and name not in args.only:
            continue
        if importlib.util.find_spec(f"benchmarks.{name}") is None:
            print(f"== {name}: benchmarks/{name}.py is not in this tree; skipped")
            runs[name] = dict(status="absent", elapsed_s=0.0, result=None)
            continue
        if args.report_only:
            runs[name] = stored_run(name, args.results_dir)
            continue
        print(f"== {name}", flush=True)
        runs[name] = run_one(name, style, args.results_dir, args.quick, args.threads)
        print(f"== {name}: {runs[name]['status']} in {runs[name]['elapsed_s']:.0f} s", flush=True)
    latest = dict(
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        quick=args.quick,
        elapsed_s=time.perf_counter() - t_start,
        commit=git_commit(),
        machine=dict(
            **machine_info(),
            torch_threads=args.threads,
            load_average_before=load_before,
            load_average_after=os.getloadavg(),
        ),
        benchmarks=runs,
    )
    common.write_result("latest", latest, args.results_dir)
    report = write_report(latest, args.results_dir, plots=not args.no_plots)
    print(f"wrote {args.results_dir / 'latest.json'} and {report} in {latest['elapsed_s']:.0f} s")
    return 0 if all(r["status"].startswith("ok") or r["status"] == "absent" for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
