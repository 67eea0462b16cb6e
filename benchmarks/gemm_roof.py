"""The linears of a real model against this CPU's compute roof (issue "real-model throughput").

    python -m benchmarks.gemm_roof [--model models/qwen2.5-coder-0.5b] [--hf models/qwen2.5-coder-0.5b-bf16]
        [--rows 1,16,64,256] [--threads 1,2]

The roof is measured, not looked up: a loop of independent multiply-adds compiled here with the
same compiler and instruction set as the native kernels (``kernels/cpu/native_build.py``) gives the
core's fp32 FMA rate (GFLOP/s), and a loop of the int8 dot-product chain the int8-activation kernels
use (AVX2: ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``; AVX-512 VNNI: ``vpdpbusd``) gives its int8 rate
(GOP/s, a multiply and an add counted as two ops), each on 1 and 2 threads at once.

Then each linear of the model's first layer and its LM head, as the engine built them from the file
(the GGUF's blocks on the int8-activation or float kernels; the bf16 directory's weights on the
native GEMM as the engine's ``auto`` keeps them, and the same weights in fp32), is timed on M rows
of random activations: achieved GFLOP/s (2 M N K / t) and its fraction of the roof for the
arithmetic that kernel runs (fp32 FMA for the float kernels, int8 dots for the int8 ones, and
``VDPBF16PS`` chains for the bf16 directory's linears again with ``linear_dtype="bfloat16"``, where
the CPU has AVX512-BF16).
Medians of ``--reps`` calls after a warm-up; the weights of one layer fit the L3 here, which is the
compute-bound regime this measures (prefill and batched decode); batch-1 streaming is
``benchmarks/kquant_gemv.py``'s.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.kquant_gemv import timed
from kernels.cpu import native_build

PEAK_SRC = r"""
#include <stdint.h>
#include <immintrin.h>
/* The vector width the kernels run: 512 bits on an AVX-512 build, else 256 (an AVX-512 core's FMA
 * pipes do 16 lanes an instruction: a 256-bit loop measured half its rate). */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define FMA(a, x, y) _mm512_fmadd_ps(a, x, y)
#define SETF(v) _mm512_set1_ps(v)
#define ZEROF() _mm512_setzero_ps()
#define ADDF(a, b) _mm512_add_ps(a, b)
#define FIRSTF(s) _mm512_cvtss_f32(s)
#define SET8(v) _mm512_set1_epi8(v)
#define SET16(v) _mm512_set1_epi16(v)
#define ZEROI() _mm512_setzero_si512()
#define ADD32(a, b) _mm512_add_epi32(a, b)
#define DOT_BW(a, u, s) _mm512_add_epi32(a, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), ones))
#define FIRSTI(t) _mm_cvtsi128_si32(_mm512_castsi512_si128(t))
#else
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define FMA(a, x, y) _mm256_fmadd_ps(a, x, y)
#define SETF(v) _mm256_set1_ps(v)
#define ZEROF() _mm256_setzero_ps()
#define ADDF(a, b) _mm256_add_ps(a, b)
#define FIRSTF(s) _mm256_cvtss_f32(s)
#define SET8(v) _mm256_set1_epi8(v)
#define SET16(v) _mm256_set1_epi16(v)
#define ZEROI() _mm256_setzero_si256()
#define ADD32(a, b) _mm256_add_epi32(a, b)
#define DOT_BW(a, u, s) _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones))
#define FIRSTI(t) _mm256_extract_epi32(t, 0)
#endif
int32_t roof_lanes(void) { return LANES; }
/* 12 independent chains of one float step STEP(a) on x, y (two pipes x their latency in flight),
 * each in its own register (an array would go through memory): NAME(iters) returns their sum. */
#define FLOAT_CHAINS(NAME, X, Y, STEP)                                                              \
    double NAME(int64_t iters) {                                                                    \
        __typeof__(X) x = X, y = Y;                                                                 \
        vf a0 = ZEROF(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,   \
           a9 = a0, a10 = a0, a11 = a0;                                                             \
        for (int64_t it = 0; it < iters; ++it) {                                                    \
            __asm__ volatile("" : "+v"(x), "+v"(y));                                                \
            STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);                             \
            STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);                           \
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));      \
            __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));    \
        }                                                                                           \
        vf s = ADDF(ADDF(ADDF(a0, a1), ADDF(a2, a3)), ADDF(ADDF(a4, a5), ADDF(a6, a7)));            \
        s = ADDF(s, ADDF(ADDF(a8, a9), ADDF(a10, a11)));                                            \
        return (double)FIRSTF(s);                                                                   \
    }
/* fp32: FMAs */
#define F(a) a = FMA(a, x, y)
FLOAT_CHAINS(roof_fma, SETF(1.0001f), SETF(0.9999f), F)
/* int8: 6 independent chains of the kernels' dot step (u8 x s8 pairs summed to s16, pairs of those
 * to s32, added), or one vpdpbusd with VNNI (as the kernels, assembled directly); each chain its own
 * operand register, opaque to the compiler, so that no step is shared or folded. */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define D(a, u) __asm__("vpdpbusd %2, %1, %0" : "+v"(a) : "v"(u), "v"(s))
#else
#define D(a, u) a = DOT_BW(a, u, s)
#endif
int64_t roof_int8(int64_t iters) {
    vi s = SET8(-2), ones = SET16(1);
    vi u0 = SET8(3), u1 = u0, u2 = u0, u3 = u0, u4 = u0, u5 = u0;
    vi a0 = ZEROI(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    (void)ones;
    for (int64_t it = 0; it < iters; ++it) {
        __asm__ volatile("" : "+v"(u0), "+v"(u1), "+v"(u2), "+v"(u3), "+v"(u4), "+v"(u5));
        __asm__ volatile("" : "+v"(s), "+v"(ones));
        D(a0, u0); D(a1, u1); D(a2, u2); D(a3, u3); D(a4, u4); D(a5, u5);
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
    }
    vi t = ADD32(ADD32(ADD32(a0, a1), ADD32(a2, a3)), ADD32(a4, a5));
    return FIRSTI(t);
}
/* bf16 products: VDPBF16PS (two bf16 products a 32-bit lane), where the build's -march has
 * AVX512-BF16; -1 elsewhere. */
#if defined(__AVX512BF16__)
#define B(a) __asm__("vdpbf16ps %2, %1, %0" : "+v"(a) : "v"(x), "v"(y))
FLOAT_CHAINS(roof_bf16dot, SET16(0x3f80), SET16(0x3f80), B)
#else
double roof_bf16dot(int64_t iters) { (void)iters; return -1.0; }
#endif
"""
FMA_FLOPS_PER_ITER = 12 * 2  # times the lanes
BF16_FLOPS_PER_ITER = 12 * 2 * 2  # times the lanes (two products a lane an instruction)
INT8_OPS_PER_ITER = 6 * 4 * 2  # times the lanes (4 byte products a 32-bit lane)


def build_roof():
    isa = native_build.chosen_isa()
    if isa not in ("avx512", "avx2"):
        raise SystemExit(f"the roof loops are written for AVX2 / AVX-512; this CPU's build is {isa}")
    flags = ["-march=native"] if isa == "avx512" else ["-march=x86-64-v3"]
    out = Path(tempfile.mkdtemp(prefix="llmserve-roof-"))
    src = out / "roof.c"
    src.write_text(PEAK_SRC)
    so = out / "roof.so"
    cmd = [native_build.compiler(), "-O2", "-shared", "-fPIC", *flags, str(src), "-o", str(so)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(so))
    lib.roof_fma.argtypes, lib.roof_fma.restype = [ctypes.c_int64], ctypes.c_double
    lib.roof_int8.argtypes, lib.roof_int8.restype = [ctypes.c_int64], ctypes.c_int64
    lib.roof_lanes.argtypes, lib.roof_lanes.restype = [], ctypes.c_int32
    lib.roof_bf16dot.argtypes, lib.roof_bf16dot.restype = [ctypes.c_int64], ctypes.c_double
    return lib, isa


def roof(fn, per_iter: int, threads: int, iters: int = 20_000_000) -> float:
    """Ops/s of ``threads`` copies of the loop at once (ctypes drops the GIL during each call)."""
    fn(iters // 20)
    best = 0.0
    for _ in range(3):
        ts = [threading.Thread(target=fn, args=(iters,)) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, threads * iters * per_iter / (time.perf_counter() - t0))
    return best


def model_linears(path: str, dtype: str | None, linear_dtype: str | None = None) -> tuple[str, dict]:
    from engine_svc import EngineConfig
    from engine_svc.engine import LLMEngine

    config = EngineConfig(model=path, dtype=dtype, num_kv_blocks=16, device="cpu", linear_dtype=linear_dtype)
    engine = LLMEngine(config)
    model, layer = engine.model, engine.model.layers[0]
    lins = {n: getattr(layer, n) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    lins["lm_head"] = model.lm_head_proj
    products = ", bf16 products" if linear_dtype == "bfloat16" else ""
    return f"{Path(path).name} ({engine.dtype}{products})".replace("torch.", ""), lins


def kernel_name(lin) -> tuple[str, str]:
    """(what runs, the roof its arithmetic is held to: "int8", "bf16dot" or "fp32")."""
    kind = getattr(lin, "kind", "dense")
    if kind == "quantized_int8act":
        return f"int8act {getattr(lin, 'fmt', getattr(getattr(lin, 'blocks', None), 'fmt', '?'))}", "int8"
    if kind == "native":
        if getattr(lin, "products", "float32") == "bfloat16":
            return "native bf16 products", "bf16dot"
        amx = " AMX" if getattr(lin, "amx", False) else ""  # bf16 on the tiles: 3 bf16 parts a value
        return f"native {str(getattr(lin, 'weight_dtype', '')).removeprefix('torch.')}{amx}", "fp32"
    return kind, "fp32"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/qwen2.5-coder-0.5b", help="a GGUF file or its folder")
    ap.add_argument("--hf", default="models/qwen2.5-coder-0.5b-bf16", help="a bf16 HF dir ('' to skip)")
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    lib, isa = build_roof()
    roofs = {}
    for t in threads:
        roofs[t] = dict(
            fp32_gflops=roof(lib.roof_fma, FMA_FLOPS_PER_ITER * lib.roof_lanes(), t) / 1e9,
            int8_gops=roof(lib.roof_int8, INT8_OPS_PER_ITER * lib.roof_lanes(), t) / 1e9,
        )
        if lib.roof_bf16dot(1) >= 0:  # the CPU has VDPBF16PS
            roofs[t]["bf16dot_gflops"] = (
                roof(lib.roof_bf16dot, BF16_FLOPS_PER_ITER * lib.roof_lanes(), t) / 1e9
            )
        print(
            f"roof ({isa}, {t} thread(s)): fp32 FMA {roofs[t]['fp32_gflops']:.0f} GFLOP/s, "
            f"int8 dots {roofs[t]['int8_gops']:.0f} GOP/s"
            + (
                f", bf16 dots {roofs[t]['bf16dot_gflops']:.0f} GFLOP/s"
                if "bf16dot_gflops" in roofs[t]
                else ""
            ),
            flush=True,
        )
    models = [(args.model, None, None)]
    if args.hf:
        models += [(args.hf, None, None), (args.hf, "float32", None)]
        if "bf16dot_gflops" in roofs[threads[0]]:
            models.append((args.hf, None, "bfloat16"))
    figures = []
    for path, dtype, linear_dtype in models:
        label, lins = model_linears(path, dtype, linear_dtype)
        for name, lin in lins.items():
            n, k = lin_shape(lin)
            kname, arith = kernel_name(lin)
            for t in threads:
                torch.set_num_threads(t)
                peak = roofs[t][{"int8": "int8_gops", "bf16dot": "bf16dot_gflops"}.get(arith, "fp32_gflops")]
                for m in rows:
                    x = torch.randn(m, k)
                    s = timed(into_kept_output(lin, x, n)[0], args.reps)
                    gf = 2 * m * n * k / s / 1e9
                    figures.append(
                        dict(
                            model=label,
                            linear=name,
                            kernel=kname,
                            n=n,
                            k=k,
                            m=m,
                            threads=t,
                            gflops=gf,
                            roof_fraction=gf / peak,
                        )
                    )
                    print(
                        f"  {label:>40} {name:>12} {kname:>16} N={n:<6} K={k:<5} M={m:<4} t={t}: "
                        f"{gf:6.1f} GFLOP/s = {gf / peak:5.2f} of the {arith} roof",
                        flush=True,
                    )
    doc = dict(isa=isa, roofs=roofs, figures=figures)
    path = common.write_json(args.results_dir / "gemm_roof.json", doc)
    print(f"wrote {path}")
    return doc


def into_kept_output(lin, x: torch.Tensor, n: int):  # -> (the call, its kept output or None)
    """The call to time: the packed GEMMs write into one output kept across calls, as the engine's
    layer loop writes into its kept scratch. ``lin(x)`` makes a fresh output each call, and one over
    glibc's 32 MiB mmap ceiling (1,024 rows of the 0.5B's gate_up, 64 of its head) is a new mapping
    whose pages fault in on every call: that halved the measured rate at those sizes."""
    if not hasattr(lin, "_gemm"):
        return (lambda: lin(x)), None
    y = torch.empty(x.shape[0], n)
    bias = getattr(lin, "_bias_ptr", None)
    code = lin.native_entry().code  # None: the float GEMMs (small_gemm.c) take no format code

    def call():
        rc = lin._gemm(
            *(() if code is None else (code,)), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
            lin._packed_ptr, n, bias, y.data_ptr(), n, torch.get_num_threads(),
        )  # fmt: skip
        if code is not None and rc != 0:
            raise RuntimeError(f"the GEMM refused ({rc})")

    return call, y


def lin_shape(lin) -> tuple[int, int]:
    for n_attr, k_attr in (("out_features", "in_features"), ("n", "k")):
        if hasattr(lin, n_attr) and hasattr(lin, k_attr):
            return int(getattr(lin, n_attr)), int(getattr(lin, k_attr))
    return tuple(lin.weight.shape)


if __name__ == "__main__":
    main()
