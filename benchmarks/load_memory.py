"""Resident memory after loading a model, one fresh process per configuration (a process's RSS
never shrinks back to what a fresh one would hold, so configurations are not measured in one).

    python -m benchmarks.load_memory [--model models/default] [--hf-model DIR]

Prints, per configuration, the process's VmRSS after ``LLM(...)`` returned (and a small KV cache
was made: ``num_kv_blocks=16``), the same less the KV pool's resident part (on CPU the pool is lazily
backed: its written pages, read from ``/proc/self/smaps``; 0 for a fresh engine), its VmHWM (the peak
during the load), and the bytes the model's parameters hold."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CONFIGS = {
    "gguf blocks (default)": {},
    "bfloat16": {"dtype": "bfloat16"},
    "float32": {"dtype": "float32"},
}


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure_here(model: str, options: dict) -> dict:
    from engine_svc import LLM
    from engine_svc.model_setup import kv_resident_bytes

    llm = LLM(model=model, num_kv_blocks=16, **options)
    params = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    pool = kv_resident_bytes(llm.engine.runtime.kv_caches)
    return {"rss": _status("VmRSS"), "pool": pool, "peak": _status("VmHWM"), "param_bytes": params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/default")
    p.add_argument("--hf-model", help="a safetensors model directory: also measured with quantization='int8'")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child: a JSON [model, options]
    args = p.parse_args()
    if args.one:
        model, options = json.loads(args.one)
        print(json.dumps(measure_here(model, options)))
        return
    runs = [(name, args.model, opts) for name, opts in CONFIGS.items()]
    if args.hf_model:
        runs += [("HF float32", args.hf_model, {}), ("HF int8", args.hf_model, {"quantization": "int8"})]
    for name, model, opts in runs:
        out = (
            subprocess.run(
                [sys.executable, "-m", "benchmarks.load_memory", "--one", json.dumps([model, opts])],
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        r = json.loads(out)
        print(
            f"{name:24s} RSS {r['rss'] / 2**20:7.1f} MiB  less the KV pool's resident "
            f"{(r['rss'] - r['pool']) / 2**20:7.1f} MiB  peak {r['peak'] / 2**20:7.1f} MiB  "
            f"parameters {r['param_bytes'] / 2**20:7.1f} MiB"
        )


if __name__ == "__main__":
    main()
