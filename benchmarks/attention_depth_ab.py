"""The native CPU attention kernel alone at long context, A/B against another build of it: one
layer's call at Qwen2.5-Coder-0.5B's shape (14 query / 2 KV heads, head size 64, block size 16), a
decode and a 512-row chunk after DEPTHS positions, the two builds alternated in one process, best of
the rounds. One thread: CPU time of the calling thread (robust to other processes' load); more: wall
time. Each call reads the next of LAYERS caches, as a model's layers do: with LAYERS 1 a decode's
16 MiB of K/V at 16k stays in the last-level cache between calls, which no real step sees.

    python -m benchmarks.attention_depth_ab --baseline OLD.so [--threads 1] [--depths 4096,16384]
        [--layers 8] [--rounds 3] [--chunk 512] [--few 5] [--shape 0.5b|1.5b] [--amx]

``--few N``: also a sequence of N query rows at each depth (a speculative verify of N - 1 drafts, a
short chunk; 0: none), and the ratio of its call to the decode's in each build.

``--in-order``: each sequence's blocks in pool order (block i after block i - 1 in memory), as a
fresh engine's pool hands a long prompt its blocks; by default they are scattered. ``--layers``:
this VM reports a 480 MiB last-level cache, so at 16k of context 8 layers' K/V (128 MiB) is partly
read from it; 24 (the 0.5B's layers) is closer to a model's step.

``--amx`` with ``--kv-dtype bfloat16`` switches the tiles on for the bf16 build only (the default
baseline stays the fp32 build's FMA path).

``--kv-dtype bfloat16``: this tree's kernel reads a bf16 cache (its ``paged_attention:kv_bf16``
build), the baseline an fp32 cache of the same values widened (max|diff| 0: the same bits).
``--baseline`` defaults to this tree's fp32 build; ``--new PATH`` puts another build on this side
(two variants of a change against each other, both on an fp32 cache).

``--products bfloat16`` (implies ``--kv-dtype bfloat16``): this side forms attention's products in bf16
(``attention_dtype="bfloat16"``: the ``kv_bf16_dot`` builds), the baseline is the fp32-product build on
the same bf16 cache (max|diff| is then the rounding of queries and weights, not 0).

``--shape 1.5b``: Qwen2.5-Coder-1.5B's 12 query / 2 KV heads of 128. ``--amx``: this build's AMX-BF16
tile path (``LLMSERVE_AMX_ATTENTION=1``; where the tiles are granted) against the baseline.

OLD.so: the kernel built from another tree, e.g. ``git show BASE:kernels/cpu/native/paged_attention.c
> /tmp/old.c`` then ``cc`` with ``native_build``'s flags for this CPU and ``-I kernels/cpu/native``.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from kernels.cpu import native_attention

HQ, HK, D, BS = 14, 2, 64, 16
SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}


def _call(fn, q, k, v, tables, lens, qsl) -> torch.Tensor:
    out = torch.empty_like(q)
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k.data_ptr(),
        v.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        qsl.data_ptr(),
        1,
        HQ,
        HK,
        D,
        BS,
        D**-0.5,
        out.data_ptr(),
        torch.get_num_threads(),
        0,  # no sliding window
        0.0,  # no soft-cap
    )
    if rc != 0:
        raise RuntimeError(f"attention failed ({rc})")
    return out


def compare(
    old,
    new,
    depth: int,
    q_len: int,
    reps: int,
    rounds: int,
    layers: int = 1,
    in_order: bool = False,
    kv_dtype: torch.dtype = torch.float32,
    same_cache: bool = False,
) -> dict:
    ctx = depth + q_len
    nb = (ctx + BS - 1) // BS
    order = torch.arange(nb) if in_order else torch.randperm(nb + 4)[:nb]
    tables = order.to(torch.int32)[None].contiguous()
    q = torch.randn(q_len, HQ, D)
    meta = (tables, torch.tensor([ctx], dtype=torch.int32), torch.tensor([0, q_len], dtype=torch.int32))
    caches = [(torch.randn(nb + 4, BS, HK, D), torch.randn(nb + 4, BS, HK, D)) for _ in range(layers)]
    if kv_dtype != torch.float32:  # this side's cache in kv_dtype, the baseline's its values widened
        mine = [(k.to(kv_dtype), v.to(kv_dtype)) for k, v in caches]
        caches = mine if same_cache else [(k.float(), v.float()) for k, v in mine]
    else:
        mine = caches
    calls = {"old": [(q, k, v, *meta) for k, v in caches], "new": [(q, k, v, *meta) for k, v in mine]}
    pairs = zip(calls["old"], calls["new"], strict=True)
    diff = max((_call(old, *a) - _call(new, *b)).abs().max().item() for a, b in pairs)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(rounds):
        for name, fn in (("old", old), ("new", new)):
            start = clock()
            for i in range(reps):
                _call(fn, *calls[name][i % layers])
            best[name] = min(best[name], (clock() - start) / reps)
    return {
        "depth": depth,
        "q_len": q_len,
        "old_ms": best["old"] * 1e3,
        "new_ms": best["new"] * 1e3,
        "speedup": best["old"] / best["new"],
        "max_abs_diff": diff,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the other build's .so (default: this tree's fp32 build)")
    ap.add_argument("--new", help="this side's .so instead of this tree's build (fp32 cache)")
    ap.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32", help="this side's")
    ap.add_argument(
        "--products",
        choices=["float32", "bfloat16"],
        default="float32",
        help="this side's (bfloat16: a bf16 cache)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--depths", default="4096,16384")
    ap.add_argument("--layers", type=int, default=8, help="distinct caches the calls cycle through")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="the chunk's rows (0: decodes only)")
    ap.add_argument("--few", type=int, default=0, help="a few-row case's rows (0: none), e.g. 5")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="heads, KV heads, head size")
    ap.add_argument("--amx", action="store_true", help="this build on its AMX-BF16 tile path")
    ap.add_argument("--in-order", action="store_true", help="blocks in pool order (default: scattered)")
    args = ap.parse_args(argv)
    global HQ, HK, D
    HQ, HK, D = SHAPES[args.shape]
    kv_dtype = torch.bfloat16 if args.products == "bfloat16" else getattr(torch, args.kv_dtype)
    if args.amx and not native_attention.amx_tiles(True, None, (kv_dtype,)):
        raise SystemExit("the AMX-BF16 tile path does not run here (no tiles granted, or no AVX-512 build)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    new = native_attention.library(None, kv_dtype, args.products)
    if new is None:
        raise SystemExit(f"no native attention build for {args.products} products on a {kv_dtype} cache here")
    if args.new:
        tree = new
        new = ctypes.CDLL(args.new).llmserve_paged_attention_f32
        new.restype, new.argtypes = tree.restype, tree.argtypes
    if args.baseline:
        old = ctypes.CDLL(args.baseline).llmserve_paged_attention_f32
        old.restype, old.argtypes = new.restype, new.argtypes
    elif args.products == "bfloat16":
        old = native_attention.library(None, kv_dtype)
    else:
        old = native_attention.library()
    for depth in (int(d) for d in args.depths.split(",")):
        shapes = [(1, 24, args.rounds)] + ([(args.few, 16, args.rounds)] if args.few else [])
        shapes += [(args.chunk, 2, max(2, args.rounds - 1))] if args.chunk else []
        decode = None
        for q_len, reps, rounds in shapes:
            r = compare(
                old,
                new,
                depth,
                q_len,
                reps,
                rounds,
                args.layers,
                args.in_order,
                kv_dtype,
                args.products == "bfloat16",
            )
            decode = r if q_len == 1 else decode
            vs = (
                f"  x decode: baseline {r['old_ms'] / decode['old_ms']:.2f}"
                f" this {r['new_ms'] / decode['new_ms']:.2f}"
                if q_len == args.few and args.few > 1
                else ""
            )
            print(
                f"depth {depth:6d} q {q_len:4d}: baseline {r['old_ms']:8.2f} ms  this {r['new_ms']:8.2f} ms  "
                f"speedup {r['speedup']:.2f}x  max|diff| {r['max_abs_diff']:.2e}{vs}",
                flush=True,
            )


if __name__ == "__main__":
    main()
