"""The native linears on each weight format they keep, and bf16 against fp32 decode on a real model,
in one run with the sides alternating:

    python -m benchmarks.weight_formats [--quick] [--threads N] [--model models/default]

- GEMM: one panel kernel (``kernels/cpu/native/panel_gemm.h``) on fp32, bf16 (``native_gemm.py``)
  and the quantized blocks Q8_0, Q4_1, Q4_K, Q6_K (``quant_gemm.py``), and Q8_0, Q4_1, Q4_K, Q6_K with
  int8 activations (``+i8``: ``quant_int8act.py``), at M = 1, 16 and 64 rows,
  on weight shapes whose K is a whole number of K-quant super-blocks (256), each format cycling
  over enough copies of the weight (96 MB of fp32) that it comes from memory as in a decode step.
  Figures: microseconds per call, GFLOP/s, speed against fp32 (the weight bytes over bandwidth set
  the decode rate: bf16 streams half of fp32's bytes).
- decode: batch-1 greedy decode of the real model (SmolLM2-135M-Instruct by default, its GGUF blocks
  dequantized: ``quantization="none"``) with ``dtype="float32"`` against ``dtype="bfloat16"`` (bf16
  weights on the native GEMM, fp32 activations), both engines loaded, runs alternating. Target
  (issue 29): bf16 >= 1.6x fp32.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.cpu_kernels import median_time
from kernels.cpu import native_gemm, quant_gemm, quant_int8act
from tests.gguf_files import random_k_blocks

FULL = dict(
    reps=5,
    rounds=3,
    shapes={"1024 -> 2816": (2816, 1024), "2816 -> 1024": (1024, 2816)},
    rows=(1, 16, 64),
    cold_bytes=96 << 20,
    decode_tokens=64,
    decode_rounds=4,
)
QUICK = dict(
    reps=2,
    rounds=1,
    shapes={"256 -> 96": (96, 256)},
    rows=(1, 16),
    cold_bytes=0,
    decode_tokens=0,
    decode_rounds=0,
)
# "+i8": the same blocks with int8 activations (kernels/cpu/quant_int8act.py)
FORMATS = ("fp32", "bf16", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0+i8", "Q4_1+i8", "Q4_K+i8", "Q6_K+i8")


def make_linear(fmt: str, w: torch.Tensor, seed: int):
    if fmt == "fp32":
        return native_gemm.NativeLinear(w)
    if fmt == "bf16":
        return native_gemm.NativeLinear(w, weight_dtype=torch.bfloat16)
    n, k = w.shape
    fmt, int8_act = fmt.removesuffix("+i8"), fmt.endswith("+i8")
    if fmt in ("Q4_K", "Q6_K"):  # no K-quant quantizer in gguf: random blocks, sane scales
        qw = quant_gemm.from_gguf_blocks(fmt, random_k_blocks(n, k, fmt, seed), (n, k))
    else:
        qw = quant_gemm.quantize_rows(w, fmt)
    return quant_int8act.Int8ActLinear(qw) if int8_act else quant_gemm.QuantLinear(qw)


def gemm_rows(w: dict) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(1)
    for name, (n, k) in w["shapes"].items():
        copies = max(1, -(-w["cold_bytes"] // (n * k * 4)))
        weights = [torch.randn(n, k, generator=g) * k**-0.5 for _ in range(copies)]
        lins = {f: [make_linear(f, x, i) for i, x in enumerate(weights)] for f in FORMATS}
        for m in w["rows"]:
            x = torch.randn(m, k, generator=g)
            best = {f: float("inf") for f in FORMATS}
            for _ in range(w["rounds"]):
                for f in FORMATS:
                    t = median_time(lambda ls=lins[f], x=x: [lin(x) for lin in ls], w["reps"]) / copies
                    best[f] = min(best[f], t)
            for f in FORMATS:
                rows.append(
                    dict(
                        shape=name,
                        m=m,
                        n=n,
                        k=k,
                        format=f,
                        us_per_call=best[f] * 1e6,
                        gflops=2 * m * n * k / best[f] / 1e9,
                        vs_fp32=best["fp32"] / best[f],
                    )
                )
            print(
                f"  GEMM {name} M={m:<3}: "
                + ", ".join(f"{f} {best[f] * 1e6:.0f} us ({best['fp32'] / best[f]:.2f}x)" for f in FORMATS)
            )
    return rows


def decode_ratio(w: dict, model: Path) -> dict | None:
    if not w["decode_tokens"]:
        return None
    if not model.exists():
        print(f"  decode: no model at {model}, skipped")
        return None
    from engine_svc import SamplingParams
    from engine_svc.llm import LLM

    arms = {
        dt: LLM(model=str(model), dtype=dt, quantization="none", max_model_len=512)
        for dt in ("float32", "bfloat16")
    }
    backends = {dt: llm.engine.model.linear_backend for dt, llm in arms.items()}
    params = SamplingParams(temperature=0.0, max_tokens=w["decode_tokens"], ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 120))}]
    times = {dt: [] for dt in arms}
    for llm in arms.values():
        llm.generate(prompt, params, use_tqdm=False)  # warm-up
    for _ in range(w["decode_rounds"]):
        for dt, llm in arms.items():
            t = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            times[dt].append(time.perf_counter() - t)
    per_token = {dt: min(v) / w["decode_tokens"] for dt, v in times.items()}
    ratio = per_token["float32"] / per_token["bfloat16"]
    print(
        f"  decode batch 1: fp32 {per_token['float32'] * 1e3:.2f} ms/token, bf16 "
        f"{per_token['bfloat16'] * 1e3:.2f} ms/token ({backends['bfloat16']}): {ratio:.2f}x"
    )
    return dict(ms_per_token={k: v * 1e3 for k, v in per_token.items()}, ratio=ratio, backends=backends)


def main() -> dict:
    import argparse
    import sys

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", type=Path, default=Path("models/default"))
    known, rest = p.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    args, t_start, w, _ = common.begin(__doc__.split("\n\n")[0], FULL, QUICK)
    gemm = gemm_rows(w)
    decode = decode_ratio(w, known.model)
    targets = []
    if decode is not None:
        targets.append(common.target("bf16 / fp32 batch-1 decode", decode["ratio"], ">=", 1.6, "x"))
    return common.finish(
        "weight_formats", args, dict(workload=w, model=str(known.model)), dict(gemm=gemm, decode=decode),
        targets, None, t_start,
    )  # fmt: skip


if __name__ == "__main__":
    main()
