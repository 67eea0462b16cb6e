"""The int8-activation GEMM of two builds alternated in one process, on a real model's linears.

    python -m benchmarks.qi8_amx_ab --base /tmp/qi8_base.so [--new PATH] [--model models/qwen2.5-coder-0.5b]
        [--rows 64,256,512,2048] [--threads 2] [--rounds 4]

``--base`` is a ``quant_int8act`` library built elsewhere (e.g. from main into /tmp); ``--new`` the
one this tree builds (the default). Each linear of the model's first layer and its LM head, packed
once (the packing is the same bytes in both builds), is called on M rows of random activations by
each build in turn, ``--rounds`` times (old, new, old, new, ...), ``--reps`` calls a turn; the
outputs are compared bit for bit and the ratio old / new time (above 1: the new build is faster)
is reported per round and as the median, with each build's GOP/s (2 M N K / t).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from benchmarks.gemm_roof import model_linears
from kernels.cpu import native_build, quant_int8act


def load(path: str) -> ctypes.CDLL:
    native_build.load("thread_pool", "generic")  # the kernels' pool, loaded globally first
    lib = ctypes.CDLL(path)
    for name, (args, res) in quant_int8act._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def call(lib, lin, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    m, k = x.shape
    rc = lib.llmserve_qi8_gemm(
        lin.code,
        x.data_ptr(),
        m,
        k,
        k,
        lin.packed.data_ptr(),
        lin.out_features,
        None if lin.bias is None else lin.bias.data_ptr(),
        y.data_ptr(),
        lin.out_features,
        threads,
    )
    if rc != 0:
        raise RuntimeError(f"gemm returned {rc}")


def turn(lib, lin, x, y, threads, reps) -> float:
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call(lib, lin, x, y, threads)
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument(
        "--new", default=None, help="a build, or several separated by commas (each against --base)"
    )
    ap.add_argument("--model", default="models/qwen2.5-coder-0.5b")
    ap.add_argument("--rows", default="64,256,512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated linear names")
    ap.add_argument("--amx", type=int, default=1, help="0: both builds with the tiles off")
    args = ap.parse_args(argv)
    new_path = args.new or str(native_build.build("quant_int8act", native_build.chosen_isa()))
    libs = {"old": load(args.base)}
    for i, path in enumerate(new_path.split(",")):
        libs["new" if i == 0 else f"new{i}"] = load(path)
    for lib in libs.values():
        lib.llmserve_qi8_amx(args.amx)
        print("amx", lib.llmserve_qi8_amx(-1), "vnni", lib.llmserve_qi8_vnni(-1))
    label, lins = model_linears(args.model, None)
    only = [s for s in args.only.split(",") if s]
    torch.manual_seed(0)
    for name, lin in lins.items():
        if only and name not in only:
            continue
        n, k = lin.out_features, lin.in_features
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k)
            ys = {key: torch.empty(m, n) for key in libs}
            for key, lib in libs.items():
                call(lib, lin, x, ys[key], args.threads)
            news = [key for key in libs if key != "old"]
            same = all(torch.equal(ys["old"].view(torch.int32), ys[key].view(torch.int32)) for key in news)
            times = {key: [] for key in libs}
            for _ in range(args.rounds):
                for key, lib in libs.items():
                    times[key].append(turn(lib, lin, x, ys[key], args.threads, args.reps))
            gops = {key: 2 * m * n * k / statistics.median(t) / 1e9 for key, t in times.items()}
            parts = []
            for key in news:
                ratios = [o / nw for o, nw in zip(times["old"], times[key], strict=True)]
                parts.append(
                    f"{key} {gops[key]:4.0f} GOP/s {statistics.median(ratios):.3f}x "
                    f"({', '.join(f'{r:.2f}' for r in ratios)})"
                )
            bits = "same" if same else "DIFFER"
            print(
                f"{label} {name:>12} {lin.fmt:>10} N={n:<6} K={k:<5} M={m:<5} bits {bits}"
                f"  old {gops['old']:4.0f} GOP/s; " + "; ".join(parts),
                flush=True,
            )


if __name__ == "__main__":
    main()
