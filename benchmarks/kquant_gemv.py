"""Batch-1 GEMV speed of the int8-activation kernel (kernels/cpu/native/quant_int8act.c) on the
K-quant forms served from their super-blocks, at a model's shapes, in GB/s of packed weight bytes
streamed (the packed form holds the file's bytes per weight: Q4_K 4.625 bits, Q6_K 6.5625).

    python -m benchmarks.kquant_gemv [--threads 1,2] [--reps 20] [--shapes 1.5b|0.5b] [--baseline SO]

``--lib``: time that build (.so) instead of the source's. ``--baseline``: another build of the
library (a .so of quant_int8act.c, e.g. the cache's file of
the previous commit), timed alternating with this one on the same packed bytes: ``speedup`` is
baseline time / ours.

Random quants and scales (the speed does not depend on the values). Each shape and format is timed
with a plain streaming read of a buffer of the same size right after it (``memsum``: numpy's sum of
an int64 view, one thread), alternating, so the printed ratio ``gemv / memsum`` is judged within
one run on a shared machine, never by the absolute figures.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch

from kernels.cpu import quant_int8act as qa

SHAPES = {  # (n, k): the 1.5B's q/o, k/v, gate/up, down and LM head
    "1.5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)],
    "0.5b": [(896, 4864), (151936, 896)],
}
FORMATS = ("Q4_K", "Q6_K")


def packed_weight(lib, fmt: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    code = qa.K_FORMATS[fmt]
    supers = k // qa.QK_K
    if fmt == "Q4_K":
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        sc = rng.integers(0, 64, (n, supers * 8), dtype=np.uint8)
        mn = rng.integers(0, 64, (n, supers * 8), dtype=np.uint8)
    else:
        q = rng.integers(-32, 32, (n, k), dtype=np.int8).view(np.uint8)
        sc = rng.integers(-128, 128, (n, supers * 16), dtype=np.int8).view(np.uint8)
        mn = None
    dsup = (rng.random((n, supers, 2), dtype=np.float32) * 1e-3).astype(np.float16).view(np.uint16)
    packed = torch.empty(lib.llmserve_qi8_packed_bytes(code, n, k), dtype=torch.uint8)
    args = [np.ascontiguousarray(a) for a in (q, dsup, sc)] + [
        None if mn is None else np.ascontiguousarray(mn)
    ]
    ptr = [a.ctypes.data_as(ctypes.c_void_p) if a is not None else None for a in args]
    rc = lib.llmserve_qi8_pack_k(code, ptr[0], ptr[1], ptr[2], ptr[3], n, k, packed.data_ptr())
    assert rc == 0, (fmt, n, k)
    return packed


def load_baseline(path: str):
    lib = ctypes.CDLL(path)
    for name, (argtypes, restype) in qa._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def timed(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--baseline", help="another build of quant_int8act (.so) to time against")
    ap.add_argument("--lib", help="time this build (.so) instead of the source's")
    args = ap.parse_args(argv)
    lib = load_baseline(args.lib) if args.lib else qa.library()
    base = load_baseline(args.baseline) if args.baseline else None
    print(f"kernel: {qa.variant()}")
    rng = np.random.default_rng(0)
    rows = []
    for fmt in args.formats.split(","):
        code = qa.K_FORMATS[fmt]
        for n, k in SHAPES[args.shapes]:
            packed = packed_weight(lib, fmt, n, k, rng)
            nbytes = packed.numel()
            x = torch.randn(1, k)
            y = torch.empty(1, n)
            plain = np.frombuffer(packed.numpy().tobytes(), dtype=np.int64)
            for t in (int(s) for s in args.threads.split(",")):
                # Bound now: each gemv is timed within its own iteration.
                def gemv(t=t, lib=lib, code=code, x=x, k=k, packed=packed, n=n, y=y):
                    rc = lib.llmserve_qi8_gemm(
                        code, x.data_ptr(), 1, k, k, packed.data_ptr(), n, None, y.data_ptr(), n, t
                    )
                    assert rc == 0

                g, s, bt = [], [], []
                for _ in range(3):  # alternating
                    g.append(timed(gemv, args.reps))
                    s.append(timed(plain.sum, args.reps))
                    if base is not None:
                        y0 = y.clone()
                        bt.append(timed(lambda: gemv(lib=base), args.reps))
                        assert torch.equal(y, y0), "the baseline build gives other bits"
                tg, ts = statistics.median(g), statistics.median(s)
                row = dict(
                    fmt=fmt,
                    n=n,
                    k=k,
                    threads=t,
                    mb=nbytes / 1e6,
                    us=tg * 1e6,
                    gbs=nbytes / tg / 1e9,
                    memsum_gbs=nbytes / ts / 1e9,
                    ratio=ts / tg,
                )
                if bt:
                    row["speedup"] = statistics.median(bt) / tg
                rows.append(row)
                print(
                    f"{fmt} {n:>6}x{k:<5} t={t}  {nbytes / 1e6:7.2f} MB  {tg * 1e6:9.1f} us  "
                    f"{row['gbs']:6.2f} GB/s  (memsum 1t {row['memsum_gbs']:6.2f} GB/s, "
                    f"ratio {row['ratio']:.2f})"
                    + (f"  speedup over baseline {row['speedup']:.2f}x" if "speedup" in row else ""),
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
