"""Steady-decode step overhead of two trees, A/B in one session: one warm process per tree, each
holding ``benchmarks.step_overhead``'s steady all-decode engines (1, 64 and 256 running, a
zero-cost stub model), stepped in turn (old, new, old, new, ...). Each round gives each process's
own CPU time per step (``time.process_time``, which another process's load inflates less than the
wall clock), less the time inside the stub and the sampler (measured inside them, as
``step_overhead`` does). Reported: the medians per tree and new/old per batch size.

    python -m benchmarks.step_ab --old /tmp/old-4fcce04 --new . [--rounds 8 --steps 30]

Both trees need ``benchmarks/step_overhead.py`` with ``decode_engine`` (every tree since issue 41's
benchmark). Not a test: figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import gc, json, sys, time
import torch
from benchmarks import common, step_overhead as so
torch.set_num_threads(1)  # both trees the same; CPU time of one thread's work
cpu = time.process_time

class Timed:  # the CPU time spent inside the stub model and the sampler, taken out
    inside = 0.0
    def __init__(self, f):
        self.f = f
    def __call__(self, *a):
        c0 = cpu()
        r = self.f(*a)
        Timed.inside += cpu() - c0
        return r
    def compute_logits(self, h):
        c0 = cpu()
        r = self.f.compute_logits(h)
        Timed.inside += cpu() - c0
        return r
    def __getattr__(self, name):
        return getattr(self.f, name)

sizes = [int(x) for x in sys.argv[1].split(",")]
w = dict(so.FULL, stub_cost_s=0.0)
model = common.model_dir(False)
engines = {}
for n in sizes:
    engine, stub, sampler = so.decode_engine(model, n, w)
    engine.runner.sampler = Timed(sampler.sampler)
    engine.runner.forward.model = Timed(stub)
    engines[n] = engine
print("ready", flush=True)
for line in sys.stdin:
    n, steps = map(int, line.split())
    engine = engines[n]
    for _ in range(2):  # warm the caches after the other process ran
        engine.step()
    gc.collect()
    Timed.inside = 0.0
    c0 = cpu()
    for _ in range(steps):
        engine.step()
    total = cpu() - c0
    print(json.dumps(1e6 * (total - Timed.inside) / steps), flush=True)
"""


def start(tree: str, sizes: list[int]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER, ",".join(map(str, sizes))],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready", f"{tree}'s worker did not start"
    return p


def ask(p: subprocess.Popen, n: int, steps: int) -> float:
    p.stdin.write(f"{n} {steps}\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=".")
    ap.add_argument("--sizes", default="1,64,256")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    procs = {"old": start(a.old, sizes), "new": start(a.new, sizes)}
    us = {(side, n): [] for side in procs for n in sizes}
    for r in range(a.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for n in sizes:
            for side in order:
                us[side, n].append(ask(procs[side], n, a.steps))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    for n in sizes:
        old, new = statistics.median(us["old", n]), statistics.median(us["new", n])
        per_round = sorted(b / a for a, b in zip(us["old", n], us["new", n], strict=True))
        print(
            f"{n:4d} running: old {old:8.1f} us  new {new:8.1f} us  new/old {new / old:.3f}"
            f"  (per round {per_round[0]:.2f}..{per_round[-1]:.2f})"
        )


if __name__ == "__main__":
    main()
