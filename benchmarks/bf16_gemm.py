"""bf16 weights: the AMX-BF16 exact-split kernel against the AVX-512 FMA panels, on the same machine
in one process, alternated (old, new, old, new), at Qwen2.5-Coder-0.5B's shapes.

    python -m benchmarks.bf16_gemm [--rows 1,16,64,256,512] [--threads 2] [--rounds 2]

Each linear's random bf16 weight is packed both ways (``small_gemm.c``: the panels the FMA path
reads, and the tiles' layout where the OS grants AMX); enough copies of it are cycled that a call
reads its weight from beyond the L2, as a model step does. Reports the medians' GFLOP/s
(2 M N K / t) and new / old per shape and row count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.cpu import native_gemm

SHAPES = {
    "qkv": (1152, 896),
    "o": (896, 896),
    "gate_up": (9728, 896),
    "down": (896, 4864),
    "head": (151936, 896),
}


def build(n: int, k: int, amx: bool, copies: int) -> list:
    native_gemm.bf16_amx(on=amx)
    try:
        g = torch.Generator().manual_seed(n * 7 + k)
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        lins = [native_gemm.NativeLinear(w) for _ in range(copies)]
    finally:
        native_gemm.bf16_amx(on=True)
    if lins[0].amx != amx:
        raise SystemExit("the AMX-BF16 path is not granted here")
    return lins


def time_calls(lins: list, x: torch.Tensor, reps: int) -> float:
    for lin in lins:
        lin(x)
    samples = []
    for r in range(reps):
        lin = lins[r % len(lins)]
        t0 = time.perf_counter()
        lin(x)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="old/new alternations")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not native_gemm.bf16_amx():
        raise SystemExit("no AMX-BF16 here (not granted, or LLMSERVE_AMX=0): nothing to compare")
    rows = [int(r) for r in args.rows.split(",")]
    out = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(1, (48 << 20) // (n * k * 2))  # ~48 MiB of weights cycled
        paths = {False: build(n, k, False, copies), True: build(n, k, True, copies)}
        for m in rows:
            x = torch.randn(m, k)
            t = {False: [], True: []}
            for _ in range(args.rounds):
                for amx in (False, True):
                    t[amx].append(time_calls(paths[amx], x, args.reps))
            old, new = statistics.median(t[False]), statistics.median(t[True])
            flop = 2 * m * n * k / 1e9
            fma, amx = flop / old, flop / new
            out.append(dict(shape=name, n=n, k=k, m=m, fma_gflops=fma, amx_gflops=amx, ratio=old / new))
            print(
                f"{name:>8} N={n:<6} K={k:<5} M={m:<4} t={args.threads}: FMA {fma:7.1f}  AMX {amx:7.1f} "
                f"GFLOP/s  AMX/FMA {old / new:5.2f}x",
                flush=True,
            )
        del paths
    return out


if __name__ == "__main__":
    main()
