"""Attention with bf16 products on a bf16 KV cache (``attention_dtype="bfloat16"``: the
``paged_attention:kv_bf16_dot`` builds of ``kernels/cpu/native/paged_attention.c``).

Each query and each softmax weight is rounded to bf16 and the products are summed in pairs as
VDPBF16PS sums them: from 0, a pair's odd product, then its even one, each added with one rounding
(the products of two bf16 values are exact in fp32). Checked here: the kernel against a numpy
statement of that order (an independent reader), the instruction's build bit-equal to the
multiply-add build that emulates it, and a row's bits the same alone, in a batch, in any split of
its chunk, at any thread count and as the decode of its own position, on every instruction set
this CPU runs; then the engine option end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.cpu import native_attention, native_build
from tests.kernel_cases import AttentionCase, make_paged_batch

ISAS = native_build.supported_isas()
LANES = {"avx512": 16, "avx2": 8, "generic": 4}  # the kernel's W: its softmax sums' partial sums
NATIVE = native_attention.BF16_PRODUCTS_NATIVE
HAS_NATIVE = native_build.variant_runs_here(NATIVE, "avx512")

# Every build of the bf16 products: the emulating build on each instruction set, and VDPBF16PS's
# own where the CPU has AVX512-BF16.
PATHS = [*ISAS, *(["avx512+native"] if HAS_NATIVE else [])]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    isa, _, native = request.param.partition("+")
    if not native:  # the emulating build even where the instruction's would be chosen
        real = native_build.variant_runs_here
        monkeypatch.setattr(
            native_build, "variant_runs_here", lambda name, i: name != NATIVE and real(name, i)
        )
    want = NATIVE if native else native_attention.BF16_PRODUCTS_BUILD
    assert native_attention.build_name(torch.bfloat16, "bfloat16", isa) == want
    if native_attention.library(isa, torch.bfloat16, "bfloat16") is None:
        pytest.fail(
            f"the bf16-products kernel did not build for {request.param} (a C compiler is on this machine)"
        )
    return isa


def bf16_batch(case: AttentionCase, seed: int):
    """A paged batch with fp32 queries and a bf16 cache."""
    batch = make_paged_batch(case, torch.float32, seed=seed)
    batch.k_cache, batch.v_cache = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    return batch


def attend(batch, isa, q=None, tables=None, lens=None, qsl=None, threads=None):
    args = list(batch.args())
    for i, x in ((0, q), (3, tables), (4, lens), (5, qsl)):
        if x is not None:
            args[i] = x
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return native_attention.paged_attention(*args, **batch.layer, isa=isa, products="bfloat16")
    finally:
        torch.set_num_threads(old)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to nearest even to bf16 (kept as float32)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def statement(q, k, v, scale, lanes, exp, odd_first=True):
    """One query row over one partition's positions (at most 256, from 0): the order written out.
    ``odd_first=False`` is a wrong order (a pair's even product first), for the test's own check."""
    qb = round_bf16(q)
    n, d_size = k.shape
    first, second = (1, 0) if odd_first else (0, 1)
    s = np.zeros(n, np.float32)
    for d in range(0, d_size, 2):
        s = s + qb[d + first] * k[:, d + first]  # exact products, one rounding per sum
        s = s + qb[d + second] * k[:, d + second]
    s = s * np.float32(scale)
    e = round_bf16(exp(s - s.max()))
    parts = np.zeros(lanes, np.float32)
    for p in range(n):  # position p into partial sum p % W, in order; then halved
        parts[p % lanes] += e[p]
    w = lanes // 2
    while w:
        parts[:w] = parts[:w] + parts[w : 2 * w]
        w //= 2
    acc = np.zeros(d_size, np.float32)
    for p in range(0, n, 2):  # positions in pairs from an even one
        pair = [p + first, p + second] if p + 1 < n else [p]
        for i in pair:
            acc = acc + e[i] * v[i]
    return acc / parts[0]


@pytest.mark.parametrize("q_len,ctx", [(1, 1), (1, 37), (1, 256), (9, 200), (40, 255)])
def test_bf16_products_are_the_numpy_statement_of_their_order(path, q_len, ctx):
    """Within one KV partition (up to 256 positions: no online-softmax merge), every row's output
    is the statement above bit for bit, decodes and chunk rows alike; the statement with a pair's
    even product first differs (so this test can see an order)."""
    isa = path
    case = AttentionCase(((ctx, q_len),), 8, 2, 64, 16)
    batch = bf16_batch(case, seed=ctx + q_len)
    got = attend(batch, isa).numpy()
    q, k_cache, v_cache, tables, *_ = batch.args()
    positions = tables[0].long()
    k = k_cache[positions].reshape(-1, 2, 64)[:ctx].float().numpy()
    v = v_cache[positions].reshape(-1, 2, 64)[:ctx].float().numpy()

    def exp(x):
        return native_attention.softmax_exp(x, isa)

    wrong_seen = False
    for row in range(q_len):
        n = ctx - q_len + row + 1
        for h in range(8):
            want = statement(q[row, h].numpy(), k[:n, h // 4], v[:n, h // 4], batch.scale, LANES[isa], exp)
            assert np.array_equal(got[row, h], want), f"row {row} head {h} is not the statement"
            wrong = statement(
                q[row, h].numpy(), k[:n, h // 4], v[:n, h // 4], batch.scale, LANES[isa], exp, False
            )
            wrong_seen |= not np.array_equal(got[row, h], wrong)
    if ctx > 1:  # one position: its weight is 1 and its V row the output, in any order
        assert wrong_seen, (
            "the wrong order gave the same bits on every row: the test cannot tell orders apart"
        )


LONG = AttentionCase(((1300, 1), (1050, 60), (700, 1), (600, 9), (530, 3)), 14, 2, 64, 16)


@pytest.mark.parametrize(
    "case",
    [
        LONG,
        AttentionCase(((300, 1), (200, 37), (64, 64), (513, 1), (100, 9)), 12, 1, 128, 32),
        AttentionCase(((900, 1), (700, 40), (650, 5)), 8, 2, 64, 16, window=300),
        AttentionCase(((400, 1), (380, 30)), 8, 4, 32, 8, softcap=30.0),
    ],
    ids=lambda c: c.label,
)
def test_a_row_is_bit_equal_alone_in_a_batch_in_any_split_at_any_thread_count_and_as_its_decode(path, case):
    """Contexts over several KV partitions, GQA groups that fill or straddle tiles, a sliding
    window and a soft-cap: a row's bits do not depend on what shares its call."""
    isa = path
    batch = bf16_batch(case, seed=7)
    q, _, _, tables, lens, qsl, _ = batch.args()
    one = attend(batch, isa, threads=1)
    assert torch.equal(attend(batch, isa, threads=2), one), "the thread count changed a row"
    assert torch.isfinite(one).all()
    starts = qsl.tolist()

    def rows_of(b, rows, threads=2):
        lo = starts[b]
        ctx = int(lens[b]) - (starts[b + 1] - lo) + rows.stop
        return attend(
            batch,
            isa,
            q[lo + rows.start : lo + rows.stop],
            tables[b : b + 1],
            torch.tensor([ctx], dtype=torch.int32),
            torch.tensor([0, len(rows)], dtype=torch.int32),
            threads,
        )

    splits = decodes = 0
    for b, (_, q_len) in enumerate(case.requests):
        lo = starts[b]
        assert torch.equal(rows_of(b, range(q_len)), one[lo : lo + q_len]), f"sequence {b} changed alone"
        if q_len >= 4:
            for cut in (1, 3, q_len // 2):
                parts = torch.cat([rows_of(b, range(0, cut), 1), rows_of(b, range(cut, q_len))])
                assert torch.equal(parts, one[lo : lo + q_len]), f"sequence {b} split at {cut} changed"
                splits += 1
        for i in sorted({0, q_len // 2, q_len - 1}):
            assert torch.equal(rows_of(b, range(i, i + 1))[0], one[lo + i]), (
                f"sequence {b} row {i} as a decode"
            )
            decodes += 1
    assert splits and decodes


def test_the_instructions_build_is_the_emulating_builds_bits():
    """VDPBF16PS (AVX512-BF16) and the AVX-512 build that forms the same sums with two fused
    multiply-adds a pair (both run with denormals flushed, as the instruction does) give the same
    bits, decodes and chunks over several partitions."""
    if not HAS_NATIVE:
        pytest.skip("this CPU has no AVX512-BF16: only the emulating builds run here (tested above)")
    batch = bf16_batch(LONG, seed=3)
    native = native_attention.library("avx512", torch.bfloat16, "bfloat16")
    emulated = native_attention.library("avx512", torch.bfloat16, "bfloat16", emulated=True)
    assert native is not emulated
    outs = [
        native_attention.paged_attention(*batch.args(), isa="avx512", products="bfloat16", emulated=e)
        for e in (False, True)
    ]
    assert torch.equal(*outs)


def test_bf16_products_stay_near_the_exact_attention():
    """The same batch with fp32 products on the same bf16 cache: the rounding of the queries and
    the weights moves each output by about bf16's precision, not more."""
    batch = bf16_batch(LONG, seed=9)
    exact = native_attention.paged_attention(*batch.args())
    got = native_attention.paged_attention(*batch.args(), products="bfloat16")
    err = (got - exact).abs().max().item()
    assert 0 < err < 2e-2 * exact.abs().max().item(), err


def test_what_bf16_products_cannot_run_on_is_refused_with_the_reason():
    batch = make_paged_batch(LONG, torch.float32, seed=1)
    with pytest.raises(ValueError, match="reads a bf16 KV cache .* torch.float32"):
        native_attention.paged_attention(*batch.args(), products="bfloat16")
    with pytest.raises(ValueError, match="attention_dtype must be one of"):
        native_attention.paged_attention(*bf16_batch(LONG, 1).args(), products="fp8")


# --- the engine option -----------------------------------------------------------------------


def test_a_request_with_bf16_products_is_its_solo_run_in_any_mix(tiny_llama):
    """The differential mixes (chunked prefills, prefix hits, general steps, preemptions) with
    bf16 attention products: every request's tokens are its solo run's."""
    from tests.test_batch_invariance import EXAMPLES, explore

    extra = {"speculative_config": None, "max_num_batched_tokens": 16, "attention_dtype": "bfloat16"}
    required = ("chunked prefills", "prefix-hit tokens", "general steps", "preemptions")
    explore(tiny_llama, max(8, EXAMPLES // 3), extra, required)


def test_the_engine_runs_bf16_products_on_a_bf16_cache_in_the_native_layer_loop(tiny_llama, monkeypatch):
    """``attention_dtype="bfloat16"``: a bf16 cache without asking, the bundle with bf16 products,
    the whole layer loop in C with that kernel (not the Python loop), and other bits than the same
    engine with fp32 products on the same cache."""
    from engine_svc import SamplingParams
    from kernels.backend import TORCH_KERNELS_BF16_PRODUCTS
    from kernels.cpu import native_decoder
    from tests.engine_helpers import count_native_loop_runs, make_engine, random_prompts

    ran = count_native_loop_runs(monkeypatch)
    engine = make_engine(tiny_llama, attention_dtype="bfloat16")
    assert engine.runtime.kernels is TORCH_KERNELS_BF16_PRODUCTS
    assert engine.runtime.kv_cache_dtype is torch.bfloat16
    prompt = random_prompts([300], 1024, seed=4)[0]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0)

    def logprobs(engine) -> list[float]:
        engine.add_request("a", prompt, params)
        out = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                out += [lp.logprob for lp in delta.logprobs or []]
        return out

    got = logprobs(engine)
    if not native_decoder.enabled() or native_decoder._kernel_pointers(torch.bfloat16, "bfloat16") is None:
        pytest.skip("the native layer loop does not run on this machine (no build, or switched off)")
    assert ran and all(ran), f"the native loop declined the steps: {ran}"
    exact = logprobs(make_engine(tiny_llama, kv_cache_dtype="bfloat16"))
    assert len(got) == len(exact) == 6
    assert got != exact, "bf16 products gave fp32 products' bits"


def test_attention_dtype_is_checked_and_named_in_its_errors(tiny_llama):
    from engine_svc.config import EngineConfig
    from kernels.backend import select_kernels

    with pytest.raises(ValueError, match="attention_dtype must be one of .*'bfloat16'.*got 'fp16'"):
        EngineConfig(model=str(tiny_llama), attention_dtype="fp16").validate()
    with pytest.raises(ValueError, match="reads a bf16 KV cache: kv_cache_dtype must be .* got 'float32'"):
        EngineConfig(model=str(tiny_llama), attention_dtype="bfloat16", kv_cache_dtype="float32").validate()
    with pytest.raises(
        ValueError, match="device 'cpu' and kernel_backend 'torch' or 'auto', got device 'cuda'"
    ):
        select_kernels("cuda", None, "bfloat16")
    with pytest.raises(ValueError, match="got device 'cpu', kernel_backend 'reference'"):
        select_kernels("cpu", "reference", "bfloat16")


def test_without_the_native_kernel_bf16_products_are_refused_at_start(tiny_llama, monkeypatch):
    from tests.engine_helpers import make_engine

    monkeypatch.setenv("LLMSERVE_NATIVE_ATTENTION", "0")
    with pytest.raises(ValueError, match="runs on the native CPU attention kernel, switched off here"):
        make_engine(tiny_llama, attention_dtype="bfloat16")


def test_the_prefix_tiers_fingerprint_names_the_products(tiny_llama):
    """A layer's K/V depend on the attention of the layers before it: blocks written with one
    kind of products are never read back by an engine with the other."""
    from engine_svc.config import EngineConfig
    from engine_svc.kv_tiers.fingerprint import kv_fingerprint
    from kernels.backend import TORCH_KERNELS, TORCH_KERNELS_BF16_PRODUCTS

    config = EngineConfig(model=str(tiny_llama))
    prints = {
        k.name: kv_fingerprint(
            config, [(2, 4, 16, 2, 64)], (None,), torch.bfloat16, torch.device("cpu"), k.name, "avx2"
        )
        for k in (TORCH_KERNELS, TORCH_KERNELS_BF16_PRODUCTS)
    }
    assert len(set(prints.values())) == 2
