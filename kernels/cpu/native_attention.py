"""Paged attention for the CPU through the native kernel (``kernels/cpu/native/paged_attention.c``),
which reads K/V from the cache blocks in place; what it does not take goes to the torch path
(``kernels/cpu/paged_attention.py``, SDPA over gathered blocks) with the same contract.

The native kernel takes fp32 queries and caches whose head size is a multiple of 16, any number of
query heads per KV head: decodes as dot products, chunks as tiles of query vectors in the lanes
of two registers (32 vectors with AVX-512, 16 with AVX2). It was faster than the torch path at
every shape measured on AVX-512 and AVX2 (``python -m benchmarks.cpu_kernels``), cascade over shared
prefixes included. Without a C compiler, with ``LLMSERVE_NATIVE_ATTENTION=0``, or on an
instruction set where the kernel was not measured faster (``FASTER_THAN_TORCH``), everything runs
on the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels.cpu import isa_choice, native_build
from kernels.cpu import paged_attention as torch_path
from kernels.cpu.checked_once import CheckedOnce
from kernels.cpu.isa_choice import chosen_isa_in
from kernels.reference.paged_attention import check_softcap, check_window

# Where the kernel measured faster than the torch path at every shape (benchmarks/cpu_kernels.py).
# The generic build (SSE2 on x86, no fused multiply-add) ran at 0.4-1.4x of the torch path: machines
# without AVX2 run the torch path unless LLMSERVE_NATIVE_ATTENTION=1 forces it.
FASTER_THAN_TORCH = ("avx512", "avx2")


def enabled(isa: str | None = None) -> bool:
    """``LLMSERVE_NATIVE_ATTENTION``: ``0`` never, ``1`` on any instruction set, unset (``auto``)
    where it is faster; a caller naming ``isa`` (tests, benchmarks) gets that build."""
    mode = os.environ.get("LLMSERVE_NATIVE_ATTENTION", "auto")
    if mode == "0":
        return False
    return mode == "1" or isa is not None or chosen_isa_in(FASTER_THAN_TORCH)


_P = ctypes.c_void_p
_I64, _I32, _F32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float


# The caches' dtypes the kernel reads, and its build for each (native_build.VARIANTS): a bf16
# cache is widened as it is read (exact), so its results are the fp32 build's on the widened values.
BUILDS = {torch.float32: "paged_attention", torch.bfloat16: "paged_attention:kv_bf16"}

# Attention's products (``attention_dtype``): "float32", exact on the cache's values (the builds
# above), or "bfloat16" on a bf16 cache: each query and each softmax weight rounded to bf16 and the
# products summed in pairs as VDPBF16PS sums them (``paged_attention.c``, "bf16 products"). The
# instruction's build where the CPU has it, else the same bits from two fused multiply-adds a pair.
PRODUCTS = ("float32", "bfloat16")
BF16_PRODUCTS_BUILD = "paged_attention:kv_bf16_dot"
BF16_PRODUCTS_NATIVE = "paged_attention:kv_bf16_dot_native"


def build_name(
    cache_dtype: torch.dtype, products: str = "float32", isa: str | None = None, emulated: bool = False
) -> str | None:
    """The build that runs ``products`` on caches of ``cache_dtype`` for ``isa`` (None: none does;
    ``emulated``: the multiply-add build even where the CPU has VDPBF16PS)."""
    if products == "float32":
        return BUILDS.get(cache_dtype)
    if products != "bfloat16" or cache_dtype is not torch.bfloat16:
        return None
    isa = isa or isa_choice.chosen()
    if not emulated and native_build.variant_runs_here(BF16_PRODUCTS_NATIVE, isa):
        return BF16_PRODUCTS_NATIVE
    return BF16_PRODUCTS_BUILD


def library(
    isa: str | None = None,
    cache_dtype: torch.dtype = torch.float32,
    products: str = "float32",
    emulated: bool = False,
):
    """The loaded kernel's entry point for ``isa`` (default: the chosen set, asked on each call),
    caches of ``cache_dtype`` and ``products`` (``build_name``), or None."""
    isa = isa or isa_choice.chosen()
    name = build_name(cache_dtype, products, isa, emulated)
    return None if name is None else _library(isa, name)


@functools.cache
def _library(isa: str, name: str):
    lib = native_build.load_or_none(name, isa)
    if lib is None:
        return None
    fn = lib.llmserve_paged_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, *(_I32,) * 5, _F32, _P, _I32, _I32, _F32]
    return fn


def work_list_builds(isa: str | None = None) -> int:
    """How many times the calling thread's kernel built a step's work list. The kernel keeps it,
    with the metadata it was built from, in buffers reused across steps: a step's first layer builds
    it, the others (the same metadata) reuse it (``kernels/cpu/native/paged_attention.c``)."""
    lib = native_build.load_or_none("paged_attention", isa)
    builds = lib.llmserve_paged_attention_work_list_builds
    builds.restype, builds.argtypes = ctypes.c_int64, []
    return int(builds())


def split_rows(isa: str | None = None) -> int:
    """The most query rows of one sequence that the calling thread's last work list runs split-K
    (a decode's items, its rows sharing each partition: 1 for decodes only, 0 for none). A few rows
    at depth (``FEW_ROWS``, ``FEW_ROWS_DEPTH`` in the kernel) take that route instead of a chunk's
    tiles; the bits are the same either way, so the tests read the route here."""
    lib = native_build.load_or_none("paged_attention", isa)
    fn = lib.llmserve_paged_attention_split_rows
    fn.restype, fn.argtypes = ctypes.c_int32, []
    return int(fn())


def softmax_exp(x, isa: str | None = None):
    """The kernel's e^x (x <= 0: its softmax numerators and partition merges, decodes and chunks
    alike) of a float32 array, W lanes at a time and the tail one by one (the same bits), or None
    where the build is missing."""
    import numpy as np

    lib = native_build.load_or_none("paged_attention", isa)
    if lib is None:
        return None
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    fn = lib.llmserve_attention_exp
    fn.restype, fn.argtypes = None, [_P, _I64, _P]
    fn(x.ctypes.data, x.size, out.ctypes.data)
    return out


def prepare() -> str:
    """Build and load the kernel now (not in the first forward pass); says which path runs."""
    if os.environ.get("LLMSERVE_NATIVE_ATTENTION") == "0":
        return "torch (LLMSERVE_NATIVE_ATTENTION=0)"
    if not enabled():
        isa = native_build.chosen_isa()
        return f"torch (native measured slower on {isa}; LLMSERVE_NATIVE_ATTENTION=1 forces it)"
    if library() is None:
        return "torch (no native build)"
    tiles = ", AMX-BF16 tiles (LLMSERVE_AMX_ATTENTION=1)" if amx_tiles(None, None, (torch.float32,)) else ""
    return f"native ({native_build.chosen_isa()}{tiles})"


def takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes this layer's shapes and dtypes."""
    return (
        q.is_cpu  # a flag; device.type builds a device object (this runs once a layer)
        and q.dtype is torch.float32
        and k_cache.dtype in BUILDS
        and v_cache.dtype is k_cache.dtype
        and q.shape[-1] % 16 == 0
        and q.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[1] % k_cache.shape[2] == 0
    )


# The step's metadata tensors already checked (every layer of a step passes the same ones).
_checked = CheckedOnce()


def check_layout(tables, lens, qsl) -> None:
    """The metadata's shapes: a seq_lens entry and a block table row per sequence, and its query
    starts plus the end (the native layer loop checks the values in C:
    ``kernels/cpu/native/decoder_loop.c``)."""
    if (
        tables.dim() != 2
        or lens.dim() != 1
        or qsl.shape != (lens.shape[0] + 1,)
        or tables.shape[0] < lens.shape[0]
    ):
        raise ValueError(
            f"block_tables {tuple(tables.shape)}, seq_lens {tuple(lens.shape)} and query_start_loc "
            f"{tuple(qsl.shape)} must describe the same sequences"
        )


def check_inputs(q, k_cache, v_cache, tables, lens, qsl) -> tuple:
    """What the kernel reads unchecked through raw pointers, checked before it runs (a bad input is
    an error naming it, never a read outside a tensor): the value cache matches the key cache and both
    the queries' head size, the metadata has one entry per sequence, every block id is inside the
    cache, every context fits its table and holds its queries, and the queries are the tokens
    ``query_start_loc`` counts. Returns the kernel's metadata arguments (made once a step, with the
    check)."""
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache {v_cache.dtype}{tuple(v_cache.shape)} differs from "
            f"k_cache {k_cache.dtype}{tuple(k_cache.shape)}"
        )
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"the caches {tuple(k_cache.shape)} must be [blocks, block_size, kv_heads, head_size] with "
            f"the head size of the queries {tuple(q.shape)} [tokens, heads, head_size]"
        )
    check_layout(tables, lens, qsl)
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    bounds = (num_blocks, block_size, q.shape[0])
    if _checked.seen(tables, lens, qsl, bounds=bounds):
        return _checked.payload
    if lens.numel() and int(lens.max()) > tables.shape[1] * block_size:
        raise IndexError(
            f"a context of {int(lens.max())} tokens overruns its block table "
            f"({tables.shape[1]} blocks of {block_size})"
        )
    # The entries the kernel reads (a row's padding past its context is never read, so not checked).
    read = torch.arange(tables.shape[1]) < ((lens.to(torch.int64) + block_size - 1) // block_size)[:, None]
    used = tables[: lens.shape[0]][read]
    if used.numel():
        lo, hi = (int(v) for v in torch.aminmax(used))
        if lo < 0 or hi >= num_blocks:
            raise IndexError(
                f"block table entry {lo if lo < 0 else hi} outside the cache's {num_blocks} blocks"
            )
    if int(qsl[0]) != 0 or int(qsl[-1]) != q.shape[0] or (lens.numel() and bool((qsl[1:] < qsl[:-1]).any())):
        raise ValueError(
            f"query_start_loc must rise from 0 to the {q.shape[0]} query tokens, got {qsl.tolist()}"
        )
    # A sequence's queries are the last of its context: a shorter context would put them before
    # position 0 (the kernel would read before its first block).
    short = (lens < qsl[1:] - qsl[:-1]).nonzero()
    if short.numel():
        b = int(short[0, 0])
        raise ValueError(
            f"seq_lens[{b}] is {int(lens[b])}, fewer than its {int(qsl[b + 1] - qsl[b])} query tokens "
            "(a context holds its queries)"
        )
    meta = (tables.data_ptr(), tables.stride(0), lens.data_ptr(), qsl.data_ptr(), lens.shape[0])
    _checked.remember(tables, lens, qsl, bounds=bounds, payload=meta)
    return meta


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """The kernel's int32 contiguous metadata (the engine's already is: then no op at all)."""
    return t if t.dtype is torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    *,
    isa: str | None = None,
    products: str = "float32",
    emulated: bool = False,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_attention.paged_attention`` (``window``: a
    sliding-window layer's width; ``softcap``: its scores' tanh soft-cap). ``products`` "bfloat16":
    bf16 products on a bf16 cache (``PRODUCTS``), native only: a ValueError where it cannot run
    (``emulated``: the multiply-add build even where the CPU has VDPBF16PS, for the tests)."""
    check_window(window)
    check_softcap(softcap)
    usable = enabled(isa) and takes(q, k_cache, v_cache)
    fn = library(isa, k_cache.dtype, products, emulated) if usable else None
    if fn is None and products != "float32":
        raise ValueError(bf16_products_unavailable(q, k_cache, products, isa))
    if fn is None:
        return torch_path.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            window=window,
            softcap=softcap,
        )
    out = torch.empty(q.shape, dtype=torch.float32)  # takes(): fp32 on the CPU
    # The engine's metadata is int32 and contiguous already (then no call at all: this runs once a
    # layer); the kernel skips sequences with no queries this step itself.
    tables, lens, qsl = as_int32(block_tables), as_int32(seq_lens), as_int32(query_start_loc)
    meta = check_inputs(q, k_cache, v_cache, tables, lens, qsl)
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *meta,  # block tables and their stride, seq_lens, query_start_loc, the number of sequences
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
        window or 0,
        softcap or 0.0,
    )
    if rc != 0:
        raise RuntimeError(f"native paged attention failed (code {rc}) at q {tuple(q.shape)}")
    return out


def paged_attention_bf16_products(*args, **kwargs) -> torch.Tensor:
    """``paged_attention`` with bf16 products (``products="bfloat16"``): the CPU kernels' bundle for
    ``attention_dtype="bfloat16"`` (kernels/backend.py)."""
    return paged_attention(*args, products="bfloat16", **kwargs)


def bf16_products_unavailable(q, k_cache, products: str = "bfloat16", isa: str | None = None) -> str:
    """Why bf16 products cannot run on these tensors here (the error's text)."""
    if products not in PRODUCTS:
        return f"attention_dtype must be one of {PRODUCTS}, got {products!r}"
    if k_cache.dtype is not torch.bfloat16:
        return (
            "attention_dtype='bfloat16' reads a bf16 KV cache (kv_cache_dtype='bfloat16'); "
            f"this one is {k_cache.dtype}"
        )
    if not enabled(isa):
        return (
            "attention_dtype='bfloat16' runs on the native CPU attention kernel, switched off here "
            "(LLMSERVE_NATIVE_ATTENTION)"
        )
    if not takes(q, k_cache, k_cache):
        return (
            f"attention_dtype='bfloat16': the native kernel does not take queries {tuple(q.shape)} "
            f"{q.dtype} (fp32 on the CPU, head size a multiple of 16)"
        )
    return (
        "attention_dtype='bfloat16' needs the native CPU attention kernel, which could not be built "
        "here (a C compiler)"
    )


def check_bf16_products(isa: str | None = None) -> None:
    """Raise ValueError (the reason) where bf16 products cannot run on this machine: the engine asks
    at start, not at its first step."""
    q, k = torch.zeros(1, 1, 16), torch.zeros(1, 16, 1, 16, dtype=torch.bfloat16)
    if not (enabled(isa) and library(isa, torch.bfloat16, "bfloat16") is not None):
        raise ValueError(bf16_products_unavailable(q, k, "bfloat16", isa))


# The tile path (AMX-BF16; ``kernels/cpu/native/paged_attention.c``, "On AMX-BF16 tiles"): where
# amx.h's probe grants the tiles, q . k and the pass over V of decodes and chunks alike run on exact
# three-part bf16 splits. The entries below switch it and expose its two products for the tests.


def amx_tiles(on: bool | None = None, isa: str | None = None, cache_dtypes=tuple(BUILDS)) -> bool:
    """Switch the tile path on or off for the ``isa`` builds of ``cache_dtypes`` (default: every
    cache dtype's; None: leave it); whether it runs now (False on a build or a machine without it)."""
    runs = []
    for build in (BUILDS[d] for d in cache_dtypes):
        lib = native_build.load_or_none(build, isa)
        if lib is None:
            return False
        fn = lib.llmserve_paged_attention_amx
        fn.restype, fn.argtypes = _I32, [_I32]
        runs.append(bool(fn(-1 if on is None else int(on))))
    return all(runs)


def _debug_call(name: str, isa: str | None, a, b, out_shape, extra: tuple = (), extra_types: tuple = ()):
    """Run a tile-path debug entry ``name(a, a rows, b, b rows, D, *extra, out)`` on fp32 copies of
    ``a`` and ``b`` (D: ``a``'s columns for the scores, ``b``'s for the V pass): the ``out_shape``
    result, or None where the build or the machine has no tiles."""
    import numpy as np

    lib = native_build.load_or_none("paged_attention", isa)
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    a, b = (np.ascontiguousarray(x, dtype=np.float32) for x in (a, b))
    out = np.empty(out_shape(a, b), dtype=np.float32)
    fn.restype, fn.argtypes = _I32, [_P, _I32, _P, _I32, _I32, *extra_types, _P]
    dim = a.shape[1] if extra else b.shape[1]
    rc = fn(a.ctypes.data, a.shape[0], b.ctypes.data, b.shape[0], dim, *extra, out.ctypes.data)
    return out if rc == 0 else None


def amx_scores(q, k, scale: float, isa: str | None = "avx512"):
    """The tile path's scores of G <= 16 queries (G x D, fp32) at n <= 256 positions (n x D):
    G x n, or None where the tiles do not run."""
    shape = lambda q, k: (q.shape[0], k.shape[0])  # noqa: E731
    return _debug_call("llmserve_attention_amx_scores", isa, q, k, shape, (scale,), (_F32,))


def amx_weighted_v(w, v, isa: str | None = "avx512"):
    """The tile path's weighted V sums of G <= 16 weight rows (G x n) over n <= 256 V rows (n x D):
    G x D, or None where the tiles do not run."""
    shape = lambda w, v: (w.shape[0], v.shape[1])  # noqa: E731
    return _debug_call("llmserve_attention_amx_weighted_v", isa, w, v, shape)


# The tile path's products in order per 32 k steps, (C sum, A part, B part), parts 0, 1, 2: the
# six with i + j <= 2 (the three dropped are each under 2^-24 of the whole), C0 the first, C1 the
# other five. The parts of one operand stay in tiles (K's for q . k: the A tile; V's over V: the B
# tile) while the other's pass one at a time (t1 with s1, s2, s3; t2 with s1, s2; t3 with s1).
AMX_SCORE_PRODUCTS = ((0, 0, 0), (1, 1, 0), (1, 2, 0), (1, 0, 1), (1, 1, 1), (1, 0, 2))
AMX_V_PRODUCTS = ((0, 0, 0), (1, 0, 1), (1, 0, 2), (1, 1, 0), (1, 1, 1), (1, 2, 0))


def amx_tile_product_reference(a, b, products):
    """C0 + C1 (+ C2 where a product names it) of a (m x k) times b (k x n), both fp32, as the tile
    path computes it, in
    numpy, bit for bit: each split into three bf16 parts (``native_gemm.bf16_split``); per 32 k
    steps, the products in order, each a TDPBF16PS into its level's C (from zero): the even and the
    odd k of the 16 pairs as two fp32 chains from zero (a product of two bf16 is exact in fp32, so
    each step is one fp32 rounding; subnormal results flushed), then C = C + (E + O)."""
    import numpy as np

    from kernels.cpu.native_gemm import _ftz, bf16_split

    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    m, k = a.shape
    pad = -k % 32
    ap = [np.pad(p, ((0, 0), (0, pad))) for p in bf16_split(a)]
    bp = [np.pad(p, ((0, pad), (0, 0))) for p in bf16_split(b)]
    c = [np.zeros((m, b.shape[1]), dtype=np.float32) for _ in range(1 + max(p[0] for p in products))]
    for t in range((k + pad) // 32):
        for level, i, j in products:
            chains = []
            for e in (0, 1):
                ch = np.zeros_like(c[0])
                for p in range(16):
                    kk = 32 * t + 2 * p + e
                    ch = _ftz(ch + np.outer(ap[i][:, kk], bp[j][kk, :]))
                chains.append(ch)
            c[level] = _ftz(c[level] + _ftz(chains[0] + chains[1]))
    rest = c[1] if len(c) == 2 else (c[1] + c[2]).astype(np.float32)
    return (c[0] + rest).astype(np.float32)


def amx_scores_reference(q, k, scale: float, products=AMX_SCORE_PRODUCTS):
    """The tile path's scores in numpy: the K rows' parts as the A tile (positions in rows), the
    queries' as the B tile (queries in columns); (C0 + C1) * scale, transposed to G x n."""
    import numpy as np

    c = amx_tile_product_reference(np.asarray(k, np.float32), np.asarray(q, np.float32).T, products)
    return (c * np.float32(scale)).astype(np.float32).T


def amx_weighted_v_reference(w, v, products=AMX_V_PRODUCTS):
    """The tile path's weighted V sums in numpy: the weights' parts as the A tile (queries in rows,
    positions the k steps), V's as the B tile (pairs of positions interleaved, dims in columns)."""
    return amx_tile_product_reference(w, v, products)
