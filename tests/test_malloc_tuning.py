"""The engine process's malloc settings keep a step's buffers off fresh mmaps: counted in page
faults, not in seconds. With the 256 KiB mmap threshold the engine once set, every step's logits
(32 rows x 8192 ids x 4 bytes = 1 MiB here) and activations were new mappings that the kernel
zero-filled page by page on first touch; the engine server ran at about half its offline speed."""

from __future__ import annotations

import json
import subprocess
import sys

from engine_svc.server import malloc_tuning

# One child process per setting: mallopt changes the process for good.
CHILD = r"""
import ctypes, ctypes.util, json, resource, sys
import torch
torch.set_num_threads(1)
from engine_svc.server import malloc_tuning
if sys.argv[2] == "engine":
    assert malloc_tuning.fix_mmap_threshold()
else:
    mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    assert mallopt(malloc_tuning.M_MMAP_THRESHOLD, int(sys.argv[2]))
    assert mallopt(malloc_tuning.M_TRIM_THRESHOLD, 1 << 20)
from engine_svc import EngineConfig, SamplingParams
from engine_svc.engine import LLMEngine
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32", num_kv_blocks=512,
                                max_seqs_per_step=32))  # all 32 decode every step
# The CPU KV pool is lazily backed (engine_svc/lazy_memory.py): a page of it faults in on its first
# write, by design. Written once here, so that the count below is the step's own buffers only.
for cache in {c.data_ptr(): c for c in engine.runner.forward.kv_caches}.values():
    cache.fill_(0.0)
params = SamplingParams(max_tokens=60, ignore_eos=True)
for i in range(32):
    engine.add_request(f"r{i}", [3 + i + j for j in range(24)], params)
for _ in range(8):  # prefill and the first decodes: the heap reaches its working size
    engine.step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
steps = 40
for _ in range(steps):
    assert len(engine.step()) == 32
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults_per_step": faults / steps}))
"""


def faults_per_step(model_dir, setting: str) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), setting],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["faults_per_step"]


def test_decode_steps_reuse_their_buffers_instead_of_faulting_in_new_ones(default_model_dir):
    assert malloc_tuning.MMAP_THRESHOLD_BYTES >= 32 << 20
    ours = faults_per_step(default_model_dir, "engine")
    # The control: the old threshold faults in at least the logits' 256 pages every step, so the
    # bound below tells the two apart.
    old = faults_per_step(default_model_dir, str(256 << 10))
    assert old > 256, old
    assert ours < 32, f"{ours:.0f} page faults per decode step (the 256 KiB threshold: {old:.0f})"
