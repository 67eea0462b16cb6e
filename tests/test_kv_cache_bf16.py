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
    if not tiles:  # the FMA path on both builds (a bf16 cache takes the tiles by default where granted)
        native_attention.amx_tiles(False, isa)
        try:
            yield isa
        finally:
            _default_tiles(isa)
        return
    if not native_attention.amx_tiles(True, isa):
        native_attention.amx_tiles(False, isa)
        pytest.skip("this machine does not grant AMX-BF16 tiles (amx.h's probe)")
    try:
        yield isa
    finally:
        native_attention.amx_tiles(False, isa, (torch.float32,))
        _default_tiles(isa)


def _default_tiles(isa: str) -> None:
    """Each build's tiles back to their default: off for an fp32 cache, on for a bf16 one."""
    native_attention.amx_tiles(False, isa, (torch.float32,))
    native_attention.amx_tiles(True, isa, (torch.bfloat16,))


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


# --- the engine on a bf16 cache -------------------------------------------------------------------


def test_a_bf16_cache_holds_half_the_bytes_and_layer_0_is_the_fp32_cache_rounded(tiny_llama):
    """The pool is bf16 and a token costs half the bytes (twice the blocks from one budget). Layer
    0's keys and values depend on the tokens alone (no attention before them), so the bf16
    engine's layer-0 cache must hold the fp32 engine's layer-0 values rounded, bit for bit: the
    writer checked in place against an independent run."""
    from engine_svc import SamplingParams
    from tests.engine_helpers import make_engine, random_prompts, run_to_completion

    budget = 1 << 20
    engines = {
        kv: make_engine(tiny_llama, kv_cache_dtype=kv, num_kv_blocks=None, kv_cache_memory=budget)
        for kv in ("float32", "bfloat16")
    }
    blocks = {kv: e.runtime.kv_caches[0].shape[1] for kv, e in engines.items()}
    assert engines["bfloat16"].runtime.kv_caches[0].dtype is torch.bfloat16
    assert engines["float32"].runtime.kv_caches[0].dtype is torch.float32
    assert blocks["bfloat16"] == 2 * blocks["float32"], blocks
    prompt = random_prompts([40], 1024, seed=3)[0]
    params = SamplingParams(max_tokens=1, temperature=0)
    layer0 = {}
    for kv, e in engines.items():
        run_to_completion(e, {"a": (prompt, params)})
        cache = e.runtime.kv_caches[0]  # [2, blocks, block_size, kv heads, head dim]
        rows = cache.reshape(2, -1, *cache.shape[3:])
        written = rows.float().abs().sum(dim=(0, 2, 3)) > 0
        layer0[kv] = rows[:, written]
        assert layer0[kv].shape[1] >= 32, "the prompt's rows were not found in the cache"
    got, want = layer0["bfloat16"], layer0["float32"]
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


def test_a_request_on_a_bf16_cache_is_its_solo_run_in_any_mix(tiny_llama):
    """The differential mixes (chunked prefills, prefix hits, general steps, preemptions) with the
    cache in bf16: every request's tokens are its solo run's."""
    from tests.test_batch_invariance import EXAMPLES, explore

    extra = {"speculative_config": None, "max_num_batched_tokens": 16, "kv_cache_dtype": "bfloat16"}
    required = ("chunked prefills", "prefix-hit tokens", "general steps", "preemptions")
    explore(tiny_llama, max(8, EXAMPLES // 3), extra, required)


def test_kv_cache_dtype_is_checked_and_named_in_its_errors(tiny_llama):
    from engine_svc.config import EngineConfig
    from engine_svc.model_setup import resolve_kv_cache_dtype

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'bfloat16'.*got 'fp8'"):
        EngineConfig(model=str(tiny_llama), kv_cache_dtype="fp8").validate()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype(None, torch.float32, cpu) is torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) is torch.bfloat16
    assert resolve_kv_cache_dtype("bf16", torch.float32, cpu) is torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, cuda) is torch.bfloat16
    with pytest.raises(
        ValueError, match="kv_cache_dtype='bfloat16' on cuda: .*activations' dtype \\(float16\\)"
    ):
        resolve_kv_cache_dtype("bfloat16", torch.float16, cuda)


@pytest.mark.parametrize("flag", ["--kv-cache-dtype", "--attention-dtype"])
def test_the_server_flag_reaches_the_engine_config(flag):
    """The cache's dtype and attention's products (tests/test_attention_bf16_products.py)."""
    from engine_svc.rpc.engine_options import engine_options_argv
    from engine_svc.server.main import build_parser, engine_config_kwargs

    args = build_parser().parse_args(["--model", "m", flag, "bfloat16"])
    assert engine_config_kwargs(args)[flag[2:].replace("-", "_")] == "bfloat16"
    argv = engine_options_argv(args)  # what llmserve serve passes on to the engine it starts
    assert argv[argv.index(flag) + 1] == "bfloat16"


def test_the_prefix_tiers_fingerprint_names_the_cache_dtype(tiny_llama):
    from engine_svc.config import EngineConfig
    from engine_svc.kv_tiers.fingerprint import kv_fingerprint

    config = EngineConfig(model=str(tiny_llama))
    prints = {
        dtype: kv_fingerprint(
            config, [(2, 4, 16, 2, 64)], (None,), dtype, torch.device("cpu"), "torch", "avx2"
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert prints[torch.float32] != prints[torch.bfloat16]


def test_the_native_layer_loop_runs_on_a_bf16_cache(tiny_llama, monkeypatch):
    """The whole layer loop in C (native_decoder.py) takes a bf16 cache with the bf16 store and
    attention entries, rather than falling back to the Python loop (the same tokens, slower)."""
    from engine_svc import SamplingParams
    from kernels.cpu import native_decoder
    from tests.engine_helpers import count_native_loop_runs, make_engine, random_prompts, run_to_completion

    ran = count_native_loop_runs(monkeypatch)
    engine = make_engine(tiny_llama, kv_cache_dtype="bfloat16")
    prompt = random_prompts([30], 1024, seed=4)[0]
    run_to_completion(engine, {"a": (prompt, SamplingParams(max_tokens=4, temperature=0))})
    if not native_decoder.enabled() or native_decoder._kernel_pointers() is None:
        pytest.skip("the native layer loop does not run on this machine (no build, or switched off)")
    assert ran and all(ran), f"the native loop declined a bf16 cache's steps: {ran}"
