"""A bf16 KV cache (``kv_cache_dtype="bfloat16"``): the native attention build that reads it
(``paged_attention:kv_bf16``) and the fused rotary-and-store that writes it, on every instruction
set this CPU runs and on the AMX-BF16 tile path where the OS grants it.

The independent reader of the attention kernel is the fp32 build on an fp32 cache holding the same
values widened (torch's own conversion): a bf16 cache's result must be bit-equal to it on every
path (decodes, chunks, a few rows at depth, windows, soft-caps, long contexts over partitions), and
differ from the fp32 cache's unrounded values (the cache really is bf16). The writer is checked
against torch's rounding of the reference composition's values."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import native_attention, native_build, native_elementwise
from kernels.reference import kv_write
from kernels.reference.rotary import apply_rotary
from tests.kernel_cases import MIXED_CASES, SPLIT_DECODE_CASES, WINDOW_CASES, AttentionCase, make_paged_batch

ISAS = native_build.supported_isas()
ATTENTION_PATHS = [*ISAS, *(["avx512+amx"] if "avx512" in ISAS else [])]
CASES = (
    *MIXED_CASES,
    *SPLIT_DECODE_CASES,
    *WINDOW_CASES,
    # Qwen2.5-0.5B's geometry over several 256-position partitions: decodes, a chunk straddling a
    # partition edge, a few rows at depth (split-K), beside each other
    AttentionCase(((1300, 1), (1050, 60), (700, 5), (600, 9)), 14, 2, 64, 16),
    AttentionCase(((900, 1), (400, 40), (33, 33)), 12, 2, 128, 16),
)


@pytest.fixture(params=ATTENTION_PATHS)
def path(request):
    isa, _, tiles = request.param.partition("+")
    for dtype in native_attention.BUILDS:
        if native_attention.library(isa, dtype) is None:
            pytest.fail(f"the native kernel ({dtype}) did not build for {isa} (a C compiler is here)")
    if not tiles:
        yield isa
        return
    if not native_attention.amx_tiles(True, isa):
        native_attention.amx_tiles(False, isa)
        pytest.skip("this machine does not grant AMX-BF16 tiles (amx.h's probe)")
    try:
        yield isa
    finally:
        native_attention.amx_tiles(False, isa)


def _attend(batch, k_cache, v_cache, isa, threads=1, **overrides):
    q, _, _, tables, lens, qsl, scale = batch.args()
    args = {"q": q, "tables": tables, "lens": lens, "qsl": qsl} | overrides
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, tables, lens, qsl = args["q"], args["tables"], args["lens"], args["qsl"]
        return native_attention.paged_attention(
            q, k_cache, v_cache, tables, lens, qsl, scale, **batch.layer, isa=isa
        )
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_a_bf16_cache_reads_as_the_fp32_build_on_its_values_widened(path, case):
    batch = make_paged_batch(case, torch.float32, seed=17)
    k16, v16 = batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)
    k32, v32 = k16.float(), v16.float()  # the same values, widened by torch
    assert native_attention.takes(batch.q, k16, v16)
    for threads in (1, 2):
        got = _attend(batch, k16, v16, path, threads)
        want = _attend(batch, k32, v32, path, threads)
        assert torch.equal(got, want), f"the bf16 cache's result is not the fp32 build's ({threads} threads)"
    rows = batch.q.shape[0]
    if rows:
        unrounded = _attend(batch, batch.k_cache, batch.v_cache, path)
        assert not torch.equal(got, unrounded), "the bf16 build read the values unrounded"


def test_a_bf16_caches_row_is_its_own_alone_and_as_a_decode(path):
    """Batch invariance on the bf16 build: each sequence alone gives its rows of the batch, and the
    last row of a chunk its decode's bits (the fp32 build's properties carry over, tested there)."""
    case = AttentionCase(((1300, 1), (1050, 60), (700, 1), (600, 9)), 14, 2, 64, 16)
    batch = make_paged_batch(case, torch.float32, seed=23)
    k16, v16 = batch.k_cache.to(torch.bfloat16), batch.v_cache.to(torch.bfloat16)
    q, _, _, tables, lens, qsl, _ = batch.args()
    whole = _attend(batch, k16, v16, path, 2)
    starts = qsl.tolist()
    for b, (ctx, q_len) in enumerate(case.requests):
        lo = starts[b]
        alone = _attend(
            batch,
            k16,
            v16,
            path,
            1,
            q=q[lo : lo + q_len],
            tables=tables[b : b + 1],
            lens=torch.tensor([ctx], dtype=torch.int32),
            qsl=torch.tensor([0, q_len], dtype=torch.int32),
        )
        assert torch.equal(alone, whole[lo : lo + q_len]), f"sequence {b} changed alone"
        last = _attend(
            batch,
            k16,
            v16,
            path,
            2,
            q=q[lo + q_len - 1 : lo + q_len],
            tables=tables[b : b + 1],
            lens=torch.tensor([ctx], dtype=torch.int32),
            qsl=torch.tensor([0, 1], dtype=torch.int32),
        )
        assert torch.equal(last[0], whole[lo + q_len - 1]), f"sequence {b}'s last row differs as a decode"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens,hq,hk,d", [(1, 8, 2, 64), (50, 4, 4, 128), (7, 6, 3, 32), (0, 2, 1, 16)])
def test_the_fused_store_rounds_into_a_bf16_cache_as_torch_does(isa, tokens, hq, hk, d):
    gen = torch.Generator().manual_seed(5)
    width = (hq + 2 * hk) * d
    qkv = torch.randn((tokens, width + 8), generator=gen)[:, :width] * 40  # a strided view, wide range
    if tokens:
        qkv[0, hq * d] = float("nan")  # a NaN key and an overflowing value round as torch's do
        qkv[-1, -1] = 3.4e38
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    cos_sin = torch.randn((64, d), generator=gen)
    blocks, bs = tokens // 4 + 3, 4
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    if tokens > 2:
        slots[1] = -1  # not stored
    cache_shape = (blocks, bs, hk, d)
    k_got = torch.zeros(cache_shape, dtype=torch.bfloat16)
    v_got = torch.zeros(cache_shape, dtype=torch.bfloat16)
    q_got = native_elementwise.rotary_store_kv(qkv, positions, cos_sin, k_got, v_got, slots, hq, hk, isa=isa)
    assert native_elementwise.library(isa) is not None
    # the reference composition in fp32, then torch's conversion into the bf16 cache
    k_ref = torch.zeros(cache_shape, dtype=torch.bfloat16)
    v_ref = torch.zeros(cache_shape, dtype=torch.bfloat16)
    q_ref = kv_write.rotary_store_kv(
        qkv, positions, cos_sin, k_ref, v_ref, slots, hq, hk, apply_rotary=apply_rotary
    )
    torch.testing.assert_close(q_got, q_ref, rtol=1e-6, atol=1e-5)
    # the keys' rotation may differ from torch's by an ulp (fused multiply-adds): compare the
    # kernel's own fp32 rotation rounded, which is what the bf16 store must hold
    k32, v32 = torch.zeros(cache_shape), torch.zeros(cache_shape)
    native_elementwise.rotary_store_kv(qkv, positions, cos_sin, k32, v32, slots, hq, hk, isa=isa)
    assert torch.equal(k_got.view(torch.int16), k32.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(v_got.view(torch.int16), v32.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(v_got.view(torch.int16), v_ref.view(torch.int16))
