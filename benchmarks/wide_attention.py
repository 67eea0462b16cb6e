"""The native CPU attention kernel at a wide step's shape (issue 44): one layer's call at
Qwen2.5-Coder-0.5B's shape (14 query / 2 KV heads of 64, block size 16) for

  decode 64 / 256   64 or 256 decodes at the 256-request workload's contexts (prompts of 32-512
                    positions plus up to 200 decoded), each sequence's blocks scattered over a
                    pool, as the engine's pool holds them after a few hundred requests
  decode 256 hot    the same calls with every block table folded onto 48 blocks (in L2): the
                    arithmetic alone, without the memory the real call waits on
  mixed             a 2,048-row step of the run's prefill phase: ~1,900 rows of prompt chunks and
                    130 decodes beside them

Each call reads the next of ``--layers`` caches, as a model's layers do. Builds given as .so paths
are alternated with this tree's in one process, ``--rounds`` times, the best of each kept, and
their outputs compared bit for bit; ms a layer and GB/s of K/V read are printed. Quiet figures
only at real-time priority (docs/performance.md): read them as ratios in one run.

    python -m benchmarks.wide_attention [--threads 2] [OLD.so ...]

OLD.so: the kernel built from another tree, e.g. ``git show main:kernels/cpu/native/paged_attention.c
> kernels/cpu/native/_old.c`` then ``cc`` with ``native_build``'s flags and ``-I kernels/cpu/native``.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import torch

from kernels.cpu import native_attention

HQ, HK, D, BS = 14, 2, 64, 16


def _batch(rng, ctxs: list[int], qlens: list[int], pool_blocks: int) -> tuple:
    nbs = [(c + BS - 1) // BS for c in ctxs]
    if sum(nbs) > pool_blocks:
        raise SystemExit(f"--pool-blocks {pool_blocks} is under the {sum(nbs)} blocks a case needs")
    perm = rng.permutation(pool_blocks)[: sum(nbs)]
    tables = torch.zeros(len(ctxs), max(nbs), dtype=torch.int32)
    i = 0
    for s, nb in enumerate(nbs):
        tables[s, :nb] = torch.from_numpy(perm[i : i + nb].astype(np.int32))
        i += nb
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    return torch.randn(int(sum(qlens)), HQ, D), tables, torch.tensor(ctxs, dtype=torch.int32), qsl


def cases(rng, pool_blocks: int) -> list[tuple[str, tuple, int]]:
    """(name, (q, block tables, seq_lens, query_start_loc), context positions read)"""
    out = []
    for nseq in (64, 256):
        ctxs = (rng.integers(32, 513, nseq) + rng.integers(1, 200, nseq)).tolist()
        out.append((f"decode {nseq}", _batch(rng, ctxs, [1] * nseq, pool_blocks), sum(ctxs)))
    q, tables, lens, qsl = _batch(rng, ctxs, [1] * 256, pool_blocks)
    out.append(("decode 256 hot", (q, tables % 48, lens, qsl), sum(ctxs)))
    plens: list[int] = []
    while sum(plens) < 1900:
        plens.append(int(rng.integers(32, 513)))
    plens[-1] -= sum(plens) - 1900
    ctxs = plens + (rng.integers(32, 513, 130) + 100).tolist()
    out.append(("mixed 1900 + 130", _batch(rng, ctxs, plens + [1] * 130, pool_blocks), sum(ctxs)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("baselines", nargs="*", help="other builds' .so, alternated with this tree's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6, help="distinct caches the calls cycle through")
    ap.add_argument("--pool-blocks", type=int, default=16384, help="blocks of each cache (256 MiB a cache)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    this = native_attention.library()
    if this is None:
        raise SystemExit("no native attention library on this machine")
    fns = [("this", this)]
    for path in args.baselines:
        f = ctypes.CDLL(path).llmserve_paged_attention_f32
        f.restype, f.argtypes = this.restype, this.argtypes
        fns.append((path.rsplit("/", 1)[-1], f))
    rng = np.random.default_rng(0)
    shape = (args.pool_blocks, BS, HK, D)
    caches = [
        (torch.empty(shape).uniform_(-2, 2), torch.empty(shape).uniform_(-2, 2)) for _ in range(args.layers)
    ]

    def call(fn, q, k, v, tables, lens, qsl):
        out = torch.empty_like(q)
        rc = fn(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), qsl.data_ptr(), lens.numel(),
            HQ, HK, D, BS, D**-0.5, out.data_ptr(), args.threads, 0, 0.0,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"attention failed ({rc})")
        return out

    for name, (q, tables, lens, qsl), positions in cases(rng, args.pool_blocks):
        outs = [call(f, q, *caches[0], tables, lens, qsl) for _, f in fns]
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        best = [float("inf")] * len(fns)
        for _ in range(args.rounds):
            for i, (_, f) in enumerate(fns):
                t = time.perf_counter()
                for k, v in caches:
                    call(f, q, k, v, tables, lens, qsl)
                best[i] = min(best[i], (time.perf_counter() - t) / args.layers)
        gb = positions * HK * D * 4 * 2 / 1e9
        row = "  ".join(
            f"{n} {b * 1e3:.2f} ms ({gb / b:.1f} GB/s)" for (n, _), b in zip(fns, best, strict=True)
        )
        ratios = " ".join(f"{b / best[0]:.2f}" for b in best[1:])
        print(
            f"{name}: {row}" + (f"; others / this {ratios}, bits same: {same}" if len(fns) > 1 else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
