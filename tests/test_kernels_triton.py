"""Every Triton kernel against its torch reference, run by Triton's interpreter on CPU tensors.

The interpreter computes bf16 wrongly, so fp32 and fp16 only here; bf16 is the GPU check's job.
The kernels are imported inside ``interpreted_kernels()`` (module-scoped) so that the interpreter is
on for exactly this module, whatever other tests imported before or import after.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# Imported here, before the interpreter is switched on, on purpose: in a full run something (torch,
# transformers) usually imports triton first, and the kernels must run interpreted all the same.
import triton.language  # noqa: F401

from kernels.reference import activation as ref_activation
from kernels.reference import kv_write as ref_kv_write
from kernels.reference import lora as ref_lora
from kernels.reference import paged_attention as ref_attention
from kernels.reference import rmsnorm as ref_rmsnorm
from kernels.reference import rotary as ref_rotary
from tests.kernel_cases import (
    MIXED_CASES,
    SPLIT_DECODE_CASES,
    WINDOW_CASES,
    WINDOW_SPLIT_CASES,
    AttentionCase,
    make_paged_batch,
)
from tests.lora_cases import LORA_CASES, lora_by_token, make_lora_case
from tests.triton_mode import interpreted_kernels

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-3)}
ATTN_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-3)}


@pytest.fixture(scope="module")
def tk():
    with interpreted_kernels():
        from kernels.triton import paged_attention, paged_attention_split_kv, paged_attention_varlen, registry

        yield SimpleNamespace(
            kernels=registry.TRITON_KERNELS,
            dispatch=paged_attention,
            split=paged_attention_split_kv,
            varlen=paged_attention_varlen,
        )


def test_kernels_are_interpreted(tk):
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tk.varlen._varlen_attention_kernel, InterpretedFunction)
    assert tk.kernels.name == "triton"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm(tk, dtype, hidden):
    torch.manual_seed(0)
    wide = torch.randn(7, hidden + 24).to(dtype)
    x = wide[:, :hidden]  # strided rows, as a slice of a bigger activation
    residual = torch.randn(7, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    out, res_out = tk.kernels.rms_norm(x, weight, 1e-6)
    ref_out, _ = ref_rmsnorm.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(res_out, x)
    out, res_out = tk.kernels.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_res = ref_rmsnorm.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(res_out, ref_res)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [176, 1100])  # 1100: more than one column tile per row
def test_silu_and_mul(tk, dtype, d):
    x = torch.randn(5, 2 * d).to(dtype)
    torch.testing.assert_close(tk.kernels.silu_and_mul(x), ref_activation.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_apply_rotary_llama3(tk, dtype, head_dim):
    torch.manual_seed(1)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cache = ref_rotary.rope_cos_sin_cache(ref_rotary.rope_inv_freq(head_dim, 10000.0, scaling), 300)
    hq, hk, tokens = 8, 2, 13
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim).to(dtype)
    # q and k as the engine gets them: non-contiguous views into one fused projection.
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.randint(0, 300, (tokens,))
    q_out, k_out = tk.kernels.apply_rotary(positions, q, k, cache)
    q_ref, k_ref = ref_rotary.apply_rotary(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])
    assert torch.equal(qkv[:, : hq * head_dim].view(tokens, hq, head_dim), q)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,strided", [(16, False), (32, False), (16, True)])
def test_write_kv(tk, dtype, block_size, strided):
    hk, d, tokens = 2, 64, 9
    kv = torch.randn(tokens, 2 * hk * d).to(dtype)
    k, v = kv[:, : hk * d].view(tokens, hk, d), kv[:, hk * d :].view(tokens, hk, d)
    slots = torch.tensor([5, -1, 3 * block_size, 2 * block_size + 7, 1, -1, 4 * block_size - 1, 40, 0])
    if strided:  # one KV cache group's row of the step's [G, T] slots, laid out [T, G] (a Gemma step's)
        slots = torch.stack([slots, slots.flip(0)], dim=1)[:, 0]
        assert slots.stride() == (2,)
    caches = [torch.randn(5, block_size, hk, d).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    tk.kernels.write_kv(k, v, *caches, slots)
    ref_kv_write.write_kv(k, v, *ref_caches, slots)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def _check_attention(tk, case: AttentionCase, dtype, seed=0, **call):
    batch = make_paged_batch(case, dtype, seed=seed)
    expected = ref_attention.paged_attention(*batch.args(), **batch.layer)
    got = tk.kernels.paged_attention(*batch.args(), **{**batch.bounds(), **batch.layer, **call})
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **ATTN_TOL[dtype])
    return batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: c.label)
def test_paged_attention_mixed_batch(tk, case, dtype):
    _check_attention(tk, case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SPLIT_DECODE_CASES, ids=lambda c: c.label)
def test_paged_attention_long_decodes_take_split_kv(tk, case, dtype, monkeypatch):
    taken = []
    real = tk.dispatch.split_kv_decode_attention
    monkeypatch.setattr(
        tk.dispatch, "split_kv_decode_attention", lambda *a, **kw: taken.append(a[-1]) or real(*a, **kw)
    )
    _check_attention(tk, case, dtype)
    assert taken and taken[0] > 1, "a long decode batch must take the split-KV path"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: c.label)
def test_paged_attention_windows_and_softcap(tk, case, dtype):
    """Sliding windows (smaller than, equal to and larger than the context; chunk tiles straddling
    the window's edge; decodes) and soft-capped scores equal the reference; the released table
    entries name a NaN page, so reading one would fail the comparison."""
    _check_attention(tk, case, dtype)


@pytest.mark.parametrize("case", WINDOW_SPLIT_CASES, ids=lambda c: c.label)
def test_windowed_and_capped_long_decodes_take_split_kv(tk, case, monkeypatch):
    taken = []
    real = tk.dispatch.split_kv_decode_attention
    monkeypatch.setattr(
        tk.dispatch, "split_kv_decode_attention", lambda *a, **kw: taken.append(a[-1]) or real(*a, **kw)
    )
    _check_attention(tk, case, torch.float32)
    assert taken and taken[0] > 1, "a long decode batch must take the split-KV path"


def test_window_and_cap_cases_can_fail():
    """The cases tell a window from one a position wider or narrower and from none, and a cap from
    none: a kernel with the window off by one (or ignored), or without the cap, fails them. And the
    windowed tables hold released entries (the NaN page) for a kernel to avoid."""
    released = 0
    for case in WINDOW_CASES + WINDOW_SPLIT_CASES:
        batch = make_paged_batch(case, torch.float32)
        want = ref_attention.paged_attention(*batch.args(), **batch.layer)
        assert torch.isfinite(want).all()
        mutants = []
        if case.window is not None:
            released += int((batch.block_tables == batch.null_block).sum())
            # finite data on the null page, so that the mutants differ by their arithmetic, not NaN
            for cache in (batch.k_cache, batch.v_cache):
                cache[batch.null_block] = torch.randn(
                    cache.shape[1:], generator=torch.Generator().manual_seed(1)
                )
            mutants += [dict(window=case.window + 1), dict(window=case.window - 1), dict(window=None)]
        if case.softcap is not None:
            mutants.append(dict(softcap=None))
        for mutant in mutants:
            got = ref_attention.paged_attention(*batch.args(), **{**batch.layer, **mutant})
            assert not torch.allclose(got, want, **ATTN_TOL[torch.float32]), (case.label, mutant)
    assert released >= 10


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_split_kv_merge_any_split_count(tk, num_splits):
    # 7 slices of a 613-token context leave short and empty slices for the shorter requests.
    batch = make_paged_batch(SPLIT_DECODE_CASES[0], torch.float32, seed=2)
    got = tk.split.split_kv_decode_attention(*batch.args(), batch.max_seq_len, num_splits)
    torch.testing.assert_close(got, ref_attention.paged_attention(*batch.args()), **ATTN_TOL[torch.float32])


def test_short_decodes_use_the_varlen_kernel(tk):
    case = AttentionCase(((3, 1), (17, 1), (100, 1)), 8, 2, 64, 16)
    assert tk.split.choose_num_splits(3, 2, 100, tk.dispatch.target_programs(torch.device("cpu"))) == 1
    _check_attention(tk, case, torch.float16)


def test_split_count_policy():
    from kernels.triton.paged_attention_split_kv import MAX_SPLITS, MIN_SPLIT_TOKENS, choose_num_splits

    assert choose_num_splits(1, 8, MIN_SPLIT_TOKENS - 1, 264) == 1  # short context: never split
    assert choose_num_splits(1, 8, 8192, 264) == min(MAX_SPLITS, 8192 // MIN_SPLIT_TOKENS, 33)
    assert choose_num_splits(256, 8, 8192, 264) == 1  # a big batch fills the device by itself


def test_paged_attention_without_host_bounds_reads_them(tk):
    _check_attention(tk, MIXED_CASES[1], torch.float32, max_query_len=None, max_seq_len=None)
    _check_attention(tk, SPLIT_DECODE_CASES[0], torch.float32, max_query_len=None, max_seq_len=None)


@pytest.mark.parametrize("case", [MIXED_CASES[1], SPLIT_DECODE_CASES[0]], ids=["mixed", "split"])
def test_paged_attention_never_reads_outside_the_context(tk, case):
    batch = make_paged_batch(case, torch.float32, seed=5)
    expected = ref_attention.paged_attention(*batch.args())
    poisoned = torch.ones(batch.k_cache.shape[:2], dtype=torch.bool)
    for b, (ctx, _) in enumerate(case.requests):
        for pos in range(ctx):
            poisoned[int(batch.block_tables[b, pos // case.block_size]), pos % case.block_size] = False
    batch.k_cache[poisoned] = float("nan")
    batch.v_cache[poisoned] = float("nan")
    got = tk.kernels.paged_attention(*batch.args(), **batch.bounds())
    torch.testing.assert_close(got, expected, **ATTN_TOL[torch.float32])


def test_paged_attention_in_a_prefill_step_after_write_kv(tk):
    # The engine's order: write this step's K/V, then attend; both kernels are Triton here.
    case = AttentionCase(((50, 18), (21, 1)), 4, 2, 64, 16)
    batch = make_paged_batch(case, torch.float16, seed=9)
    k_new = torch.randn(19, 2, 64).half()
    v_new = torch.randn(19, 2, 64).half()
    slots = []
    for b, (ctx, q_len) in enumerate(case.requests):
        for pos in range(ctx - q_len, ctx):
            slots.append(int(batch.block_tables[b, pos // 16]) * 16 + pos % 16)
    slots = torch.tensor(slots)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref_kv_write.write_kv(k_new, v_new, ref_k, ref_v, slots)
    tk.kernels.write_kv(k_new, v_new, batch.k_cache, batch.v_cache, slots)
    expected = ref_attention.paged_attention(batch.q, ref_k, ref_v, *batch.args()[3:])
    torch.testing.assert_close(
        tk.kernels.paged_attention(*batch.args(), **batch.bounds()), expected, **ATTN_TOL[torch.float16]
    )


def test_backend_switch_picks_by_device_and_logs(tk, caplog):
    from kernels.backend import TORCH_KERNELS, select_kernels

    with caplog.at_level("INFO", logger="kernels.backend"):
        assert select_kernels("cpu") is TORCH_KERNELS
        assert select_kernels("cuda").name == "triton"  # a device name alone: no GPU needed to choose
        assert select_kernels("cpu", "triton").name == "triton"
        assert select_kernels("cuda", "torch") is TORCH_KERNELS
    assert "kernels: triton on cuda" in caplog.text and "kernels: torch on cpu" in caplog.text
    with pytest.raises(ValueError, match="kernel_backend"):
        select_kernels("cpu", "cuda-graphs")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LORA_CASES, ids=[c[0] for c in LORA_CASES])
def test_lora_apply_equals_its_twin_and_the_definition(tk, case, dtype):
    """The gathered (BGMV-style) kernel vs the grouped torch twin, on a strided column slice."""
    got, twin = make_lora_case(case, dtype, "cpu"), make_lora_case(case, dtype, "cpu")
    want = lora_by_token(got)
    slots = torch.from_numpy(got.token_slots.astype("int32"))
    tk.kernels.lora_apply(got.out, got.x, got.a, got.b, slots, None, got.max_rank)
    ref_lora.lora_apply(twin.out, twin.x, twin.a, twin.b, slots, twin.plan("cpu"), twin.max_rank)
    torch.testing.assert_close(got.out, twin.out, **TOL[dtype])
    torch.testing.assert_close(got.out.float(), want, **TOL[dtype])
    base = got.token_slots < 0
    fresh = make_lora_case(case, dtype, "cpu")
    assert torch.equal(got.out[torch.from_numpy(base)], fresh.out[torch.from_numpy(base)]), (
        "a base row changed"
    )
