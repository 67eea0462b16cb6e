"""Batched throughput on a real model against vLLM's CPU build (issue "real-model throughput").

The model is a registry GGUF (``llmserve pull``) and the bf16 Hugging Face directory that transformers
writes from it (``GgufConfig(dequantize=True)`` then ``save_pretrained``: what a vLLM-CPU user would
serve, since vLLM reads no GGUF on a CPU). Three systems on the same token ids, one after another in
alternating order per repeat:

  vllm       vLLM-CPU on the bf16 directory: ``dtype=bfloat16`` where the CPU has AVX-512 BF16 or AMX,
             else ``float32`` (measured on an AVX2-only EPYC, Qwen2.5-Coder-0.5B, 4 requests: bf16, which
             is also its ``auto`` there, fell back to torch's emulated bf16 linear at 1.5-1.8 output
             tok/s; float32 gave 6.0)
  ours-bf16  llmserve on the same directory at its defaults
  ours-gguf  llmserve on the Q4_K_M file at its defaults
  ours-bf16-products  llmserve on the bf16 directory with ``linear_dtype="bfloat16"`` (the opt-in: the
             activations rounded to bf16 in the GEMMs, as vLLM computes; docs/serving.md#linear-dtype)

Workload: N requests (64 and 256 by default), prompts of 32-512 random token ids, outputs of 16-256,
greedy, ``ignore_eos``, offline ``generate`` on each side (a warm-up first). Figures: output tok/s
and the ratio of each of ours to vLLM's (target >= 1.5x). Threads: both engines at their defaults
on the machine (vLLM binds its engine to the cores its front end leaves).

    python -m benchmarks.real_peer --model qwen2.5-coder-0.5b [--requests 64 256] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmarks import common
from benchmarks.peer import run_ours
from benchmarks.vllm_peer import all_cpus, find_vllm_python, run_vllm_workloads

SYSTEMS = ("vllm", "ours-bf16", "ours-gguf", "ours-bf16-products")
DEFAULT_SYSTEMS = SYSTEMS[:3]
TARGET = 1.5


def gguf_file(name: str) -> Path:
    folder = Path("models") / name
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise SystemExit(f"no GGUF in {folder}: run `llmserve pull {name}` first")
    return files[0]


def bf16_dir(name: str) -> Path:
    """``models/<name>-bf16``: the GGUF dequantized by transformers and saved in bf16 (built once)."""
    out = Path("models") / f"{name}-bf16"
    if (out / "model.safetensors").exists() or list(out.glob("model-*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    src = gguf_file(name)
    print(f"writing {out} from {src} (transformers' GGUF loader, dequantized, bf16)", flush=True)
    kw = dict(gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kw
    )
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(src.parent, **kw).save_pretrained(partial)
    partial.rename(out)
    return out


def vllm_dtype() -> str:
    """The dtype a vLLM-CPU user gets its best speed from on this CPU (see the module's text)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def workload(num: int, vocab: int, seed: int = 1234) -> dict:
    rng = random.Random(seed + num)
    lens = [(rng.randint(32, 512), rng.randint(16, 256)) for _ in range(num)]
    prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in lens]
    return dict(prompts=prompts, output_lens=[o for _, o in lens])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a catalogue name with a GGUF in models/")
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    ap.add_argument(
        "--vllm-dtype", default=None, help="default: bfloat16 with AVX-512 BF16 / AMX, else float32"
    )
    ap.add_argument("--ours-dtype", default="auto", help="ours-bf16's dtype (auto: the engine's default)")
    ap.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args(argv)
    gguf, hf = gguf_file(args.model), bf16_dir(args.model)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    workloads = {f"n{n}": workload(n, min(vocab, 150000)) for n in args.requests}
    python, why = find_vllm_python()
    peer_dtype = args.vllm_dtype or vllm_dtype()
    print(f"peer: {why}, dtype {peer_dtype}", flush=True)
    work = common.CACHE_DIR / f"real-peer-{args.model}"
    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for rep in range(args.repeats):
        order = args.systems if rep % 2 == 0 else args.systems[::-1]
        for who in order:
            t = time.perf_counter()
            if who == "vllm":
                if not python:
                    continue
                # Both engines on every core: vLLM's own default keeps one for its scheduler (on a
                # 2-core machine its worker then computes on one thread against our two).
                res = run_vllm_workloads(
                    python, hf, workloads, work, threads_bind=all_cpus(), dtype=peer_dtype, timeout_s=7200
                )
            elif who == "ours-bf16":
                res = run_ours(hf, workloads, 0, work, dtype=args.ours_dtype, tag="-bf16")
            elif who == "ours-bf16-products":
                res = run_ours(
                    hf, workloads, 0, work, dtype=args.ours_dtype, tag="-bf16p", linear_dtype="bfloat16"
                )
            else:
                res = run_ours(gguf, workloads, 0, work, dtype="auto", tag="-gguf")
            runs[who].append(res)
            tok_s = ", ".join(f"{k} {v['output_tok_s']:.1f}" for k, v in res.items() if k != "_meta")
            cores = f", its threads on cores {res['_meta'].get('omp_cores')}" if who == "vllm" else ""
            print(f"  {who}: {tok_s} tok/s ({time.perf_counter() - t:.0f} s{cores})", flush=True)
    figures, targets = {}, []
    for name in workloads:
        best = {w: max(r[name]["output_tok_s"] for r in rs) for w, rs in runs.items() if rs}
        figures[name] = best
        for who in SYSTEMS[1:]:  # ours, each against vLLM
            if who in best and "vllm" in best:
                ratio = best[who] / best["vllm"]
                targets.append(common.target(f"{args.model} {name} {who} / vllm", ratio, ">=", TARGET, "x"))
    print(f"\n{args.model}: output tok/s (best of {args.repeats})")
    for name, best in figures.items():
        print(f"  {name}: " + "  ".join(f"{w} {v:.1f}" for w, v in best.items()))
    common.print_targets(targets)
    doc = dict(model=args.model, vllm_dtype=peer_dtype, gguf=str(gguf), bf16_dir=str(hf))
    doc.update(figures=figures, runs=runs, targets=targets)
    path = common.write_json(args.results_dir / f"real_peer_{args.model}.json", doc)
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
