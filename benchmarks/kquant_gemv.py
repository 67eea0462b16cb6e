"""Batch-1 GEMV speed of the int8-activation kernel (kernels/cpu/native/quant_int8act.c) on the
K-quant forms served from their super-blocks, at a model's shapes, in GB/s of packed weight bytes
streamed (the packed form holds the file's bytes per weight: Q4_K 4.625 bits, Q6_K 6.5625).

    python -m benchmarks.kquant_gemv [--threads 1,2] [--reps 20] [--shapes 1.5b|0.5b] [--baseline SO]
    python -m benchmarks.kquant_gemv --roof [--model FILE] [--threads 1,2] [--baseline SO]

``--roof``: this machine's memory roof, measured: a plain streaming read (AVX2 loads summed, each
thread one contiguous range) of a buffer far larger than the caches, in GB/s on each thread count.
``--model``: the decode GEMVs of a real GGUF file as the engine packs it (its real types: Q4_K,
Q6_K, Q5_0, Q8_0, mixed fused rows), each kind swept over all the layers (every call a different
layer's weight, so each streams from memory as in a decode step) and the LM head, in GB/s against
that roof; then the per-token sum of those GEMVs against the engine's own batch-1 decode step
(one request, 64 tokens): the share of a step outside the GEMVs.

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
    "gemma3": [(640, 1024), (640, 2048)],  # Gemma 3 270M's K-quant linears: o (Q4_K), down (Q4_K / Q6_K)
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


STREAM_SRC = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <immintrin.h>
typedef struct { const uint8_t *p; int64_t n; int64_t sum; } slice;
static void *read_slice(void *arg) {
    slice *s = arg;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i + 128 <= s->n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(s->p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(s->p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(s->p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(s->p + i + 96)));
    }
    __m256i t = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    s->sum = _mm256_extract_epi64(t, 0) + _mm256_extract_epi64(t, 1) + _mm256_extract_epi64(t, 2);
    return 0;
}
/* Seconds to read bytes at p (64-byte aligned) on `threads` threads, each one contiguous slice. */
double stream_read(const uint8_t *p, int64_t bytes, int threads) {
    slice s[64];
    pthread_t t[64];
    const int64_t per = bytes / threads / 128 * 128;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < threads; ++i) {
        s[i].p = p + i * per;
        s[i].n = per;
        if (i) pthread_create(&t[i], 0, read_slice, &s[i]);
    }
    read_slice(&s[0]);
    for (int i = 1; i < threads; ++i) pthread_join(t[i], 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
}
"""
ROOF_BYTES = 1 << 29  # 512 MiB: 16x this machine's L3
COLD_BYTES = 96 << 20  # --cold: 3x the L3


def build_stream():
    """The streaming-read roof's library (AVX2: the kernels' vector width on this machine)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from kernels.cpu import native_build

    out = Path(tempfile.mkdtemp(prefix="llmserve-stream-"))
    (out / "stream.c").write_text(STREAM_SRC)
    cmd = [native_build.compiler(), "-O2", "-shared", "-fPIC", "-pthread", "-march=x86-64-v3"]
    subprocess.run([*cmd, str(out / "stream.c"), "-o", str(out / "stream.so")], check=True)
    lib = ctypes.CDLL(str(out / "stream.so"))
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.stream_read.restype = ctypes.c_double
    return lib


class Stream:
    """The streaming read over a buffer of ROOF_BYTES (written: every page resident)."""

    def __init__(self):
        self.lib = build_stream()
        self.buf = torch.ones(ROOF_BYTES + 64, dtype=torch.uint8)
        self.ptr = (self.buf.data_ptr() + 63) // 64 * 64
        self.at = 0

    def seconds(self, nbytes: int, threads: int) -> float:
        """One read of ``nbytes`` (at most ROOF_BYTES) from where the last ended: cold in the caches."""
        nbytes = min(nbytes, ROOF_BYTES) // 4096 * 4096
        if self.at + nbytes > ROOF_BYTES:
            self.at = 0
        sec = self.lib.stream_read(self.ptr + self.at, nbytes, threads)
        self.at += nbytes
        return sec

    def roof(self, threads: list[int], rounds: int = 7) -> dict[int, float]:
        """GB/s of a read of the whole buffer on each thread count: the best of ``rounds``, the
        counts alternating."""
        best = dict.fromkeys(threads, 0.0)
        for _ in range(rounds):
            for t in threads:
                best[t] = max(best[t], ROOF_BYTES / self.seconds(ROOF_BYTES, t) / 1e9)
        return best


def model_sweeps(path: str, threads: list[int], reps: int, stream: Stream) -> list[dict]:
    """The engine's batch-1 GEMVs on a real file, each kind swept over every layer (module doc);
    each sweep timed alternating with a streaming read of as many bytes: ``of_roof`` is that read's
    time over the sweep's (1.0: the kernels stream the weights at the machine's read rate)."""
    from engine_svc import LLM, SamplingParams

    llm = LLM(model=path, max_num_seqs=1, enable_prefix_caching=False, num_kv_blocks=64)
    model = llm.engine.model
    kinds: dict[str, list] = {
        n: [getattr(layer, n) for layer in model.layers]
        for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    }
    kinds["lm_head"] = [model.lm_head_proj]
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        total = 0.0
        for name, lins in kinds.items():
            xs = [torch.randn(1, lin.in_features) for lin in lins]
            nbytes = sum(lin.packed.numel() for lin in lins)

            def sweep(lins=lins, xs=xs):
                for lin, x in zip(lins, xs, strict=True):
                    lin(x)

            g, r = [], []
            for _ in range(3):  # alternating
                g.append(timed(sweep, reps))
                r.append(statistics.median(stream.seconds(nbytes, t) for _ in range(reps)))
            sec, read = statistics.median(g), statistics.median(r)
            total += sec
            fmts = sorted({lin.fmt for lin in lins})
            row = dict(
                model=path,
                kind=name,
                formats=fmts,
                calls=len(lins),
                threads=t,
                mb=nbytes / 1e6,
                us=sec * 1e6,
                gbs=nbytes / sec / 1e9,
                read_gbs=nbytes / read / 1e9,
                of_roof=read / sec,
            )
            rows.append(row)
            print(
                f"{name:>12} {'/'.join(fmts):>14} x{len(lins):<3} t={t}  {nbytes / 1e6:7.1f} MB "
                f"{sec * 1e6:9.0f} us  {row['gbs']:6.2f} GB/s (the read {row['read_gbs']:6.2f}): "
                f"{row['of_roof']:.2f} of the roof",
                flush=True,
            )
        # one request of one token generating 64: 63 decode steps after one prefill step
        sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        llm.generate([[1]], sp, use_tqdm=False)
        steps = []
        for _ in range(3):
            t0 = time.perf_counter()
            llm.generate([[1]], sp, use_tqdm=False)
            steps.append((time.perf_counter() - t0) / 64)
        step = statistics.median(steps)
        all_bytes = sum(r["mb"] for r in rows if r["threads"] == t) * 1e6
        rows.append(
            dict(
                model=path,
                kind="decode step",
                threads=t,
                us=step * 1e6,
                gemv_us=total * 1e6,
                outside_gemvs=1 - total / step,
                step_gbs=all_bytes / step / 1e9,
            )
        )
        print(
            f"  t={t}: decode step {step * 1e6:.0f} us ({1 / step:.1f} tok/s, "
            f"{all_bytes / step / 1e9:.2f} GB/s of weights), the GEMVs {total * 1e6:.0f} us: "
            f"{1 - total / step:.1%} of the step outside them",
            flush=True,
        )
    llm.shutdown()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="1.5b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--baseline", help="another build of quant_int8act (.so) to time against")
    ap.add_argument("--lib", help="time this build (.so) instead of the source's")
    ap.add_argument(
        "--cold", action="store_true", help=f"cycle through copies of each weight ({COLD_BYTES >> 20} MiB)"
    )
    ap.add_argument("--roof", action="store_true", help="the streaming-read roof (and --model's GEMVs)")
    ap.add_argument("--model", help="with --roof: a GGUF file whose decode GEMVs are swept")
    args = ap.parse_args(argv)
    if args.roof:
        threads = [int(s) for s in args.threads.split(",")]
        stream = Stream()
        roof = stream.roof(threads)
        for t, gbs in roof.items():
            print(f"streaming read, {ROOF_BYTES >> 20} MiB, {t} thread(s): {gbs:.2f} GB/s", flush=True)
        rows = [dict(kind="stream roof", threads=t, gbs=g) for t, g in roof.items()]
        if args.model:
            rows += model_sweeps(args.model, threads, max(3, args.reps // 4), stream)
        return rows
    lib = qa.library()  # first: it loads the thread pool globally, which the other builds bind to
    lib = load_baseline(args.lib) if args.lib else lib
    base = load_baseline(args.baseline) if args.baseline else None
    print(f"kernel: {qa.variant()}")
    rng = np.random.default_rng(0)
    rows = []
    for fmt in args.formats.split(","):
        code = qa.K_FORMATS[fmt]
        for n, k in SHAPES[args.shapes]:
            packed = packed_weight(lib, fmt, n, k, rng)
            nbytes = packed.numel()
            # --cold: copies of the weight, called in turn, more bytes than the caches hold (a decode
            # step reads each layer's weight once: from memory, not the L3)
            copies = (
                [packed] + [packed.clone() for _ in range(-(-COLD_BYTES // nbytes) - 1)]
                if args.cold
                else [packed]
            )
            turn = [0]
            x = torch.randn(1, k)
            y = torch.empty(1, n)
            plain = np.frombuffer(packed.numpy().tobytes(), dtype=np.int64)
            for t in (int(s) for s in args.threads.split(",")):
                # Bound now: each gemv is timed within its own iteration.
                def gemv(t=t, lib=lib, code=code, x=x, k=k, copies=copies, n=n, y=y, turn=turn):
                    w = copies[turn[0] % len(copies)]
                    turn[0] += 1
                    rc = lib.llmserve_qi8_gemm(
                        code, x.data_ptr(), 1, k, k, w.data_ptr(), n, None, y.data_ptr(), n, t
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
