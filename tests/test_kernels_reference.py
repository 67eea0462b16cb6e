"""The torch reference twins against independent definitions: HF transformers' own modules and
plain dense attention over contiguous data."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.reference.activation import silu_and_mul
from kernels.reference.kv_write import write_kv
from kernels.reference.paged_attention import paged_attention
from kernels.reference.rmsnorm import rms_norm
from kernels.reference.rotary import apply_rotary, rope_cos_sin_cache, rope_inv_freq
from tests.kernel_cases import MIXED_CASES, SPLIT_DECODE_CASES, dense_causal_reference, make_paged_batch

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama_config(head_dim: int = 64, theta: float = 500000.0, scaling: dict | None = None) -> LlamaConfig:
    # transformers 5 reads rope settings from config.rope_parameters (theta included).
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": theta, **(scaling or {})},
    )


@pytest.mark.parametrize(
    "scaling",
    [None, LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0}],
    ids=["default", "llama3", "linear"],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_inv_freq_matches_transformers(scaling, head_dim):
    config = _llama_config(head_dim, scaling=scaling)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        expected = LlamaRotaryEmbedding(config).inv_freq
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    ours = rope_inv_freq(head_dim, 500000.0, scaling)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_llama3_scaling_changes_only_low_frequencies():
    plain = rope_inv_freq(128, 500000.0)
    scaled = rope_inv_freq(128, 500000.0, LLAMA3_SCALING)
    assert torch.equal(scaled[:8], plain[:8])  # short wavelengths untouched
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 8.0)  # the longest slowed by `factor`


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_transformers(dtype):
    torch.manual_seed(0)
    config = _llama_config(64, scaling=LLAMA3_SCALING)
    rope = LlamaRotaryEmbedding(config)
    tokens, hq, hk = 11, 4, 2
    positions = torch.tensor([0, 1, 2, 3, 500, 8191, 9000, 20000, 5, 6, 100000])
    q = torch.randn(tokens, hq, 64).to(dtype)
    k = torch.randn(tokens, hk, 64).to(dtype)
    cos, sin = rope(q, positions[None])  # [1, T, D]
    # HF's layout is [batch, heads, tokens, D].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = rope_cos_sin_cache(rope_inv_freq(64, 500000.0, LLAMA3_SCALING), 100001)
    q_ours, k_ours = apply_rotary(positions, q, k, cache)
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), **tol)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_is_hf_llama_rmsnorm(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x, residual = torch.randn(9, 96).to(dtype), torch.randn(9, 96).to(dtype)
    out, res_out = rms_norm(x, norm.weight.detach(), 1e-5)
    assert torch.equal(out, norm(x).detach()) and res_out is x
    out, res_out = rms_norm(x, norm.weight.detach(), 1e-5, residual)
    assert torch.equal(res_out, x + residual)
    assert torch.equal(out, norm(x + residual).detach())


def test_silu_and_mul_is_gated_silu():
    x = torch.randn(5, 2 * 48)
    assert torch.equal(silu_and_mul(x), ACT2FN["silu"](x[:, :48]) * x[:, 48:])


def test_write_kv_stores_each_token_in_its_slot_and_skips_negative_slots():
    num_blocks, block_size, hk, d = 4, 16, 2, 8
    k_cache, v_cache = torch.zeros(num_blocks, block_size, hk, d), torch.zeros(num_blocks, block_size, hk, d)
    k, v = torch.randn(5, hk, d), torch.randn(5, hk, d)
    slots = torch.tensor([0, 17, -1, 63, 35])
    write_kv(k, v, k_cache, v_cache, slots)
    written = 0
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(k_cache[slot // block_size, slot % block_size], k[t])
        assert torch.equal(v_cache[slot // block_size, slot % block_size], v[t])
        written += 1
    assert int((k_cache.abs().sum(-1) != 0).sum()) == written * hk  # nothing else touched


@pytest.mark.parametrize("case", MIXED_CASES + SPLIT_DECODE_CASES, ids=lambda c: c.label)
def test_paged_attention_reference_equals_dense_causal_sdpa(case):
    batch = make_paged_batch(case, torch.float32, seed=7)
    expected = dense_causal_reference(batch)
    torch.testing.assert_close(
        paged_attention(*batch.args(), **batch.bounds()), expected, rtol=1e-5, atol=1e-5
    )


def test_paged_attention_reference_ignores_blocks_outside_the_table():
    case = MIXED_CASES[1]
    batch = make_paged_batch(case, torch.float32, seed=3)
    before = paged_attention(*batch.args())
    used = set()
    for b, (ctx, _) in enumerate(case.requests):
        used |= set(batch.block_tables[b, : (ctx + case.block_size - 1) // case.block_size].tolist())
    unused = [i for i in range(batch.k_cache.shape[0]) if i not in used]
    assert unused
    batch.k_cache[unused] = float("nan")
    batch.v_cache[unused] = float("nan")
    # Nor may the slots past seq_len in a request's last, partly filled block.
    for b, (ctx, _) in enumerate(case.requests):
        last = int(batch.block_tables[b, (ctx - 1) // case.block_size])
        batch.k_cache[last, ctx % case.block_size or case.block_size :] = float("nan")
        batch.v_cache[last, ctx % case.block_size or case.block_size :] = float("nan")
    torch.testing.assert_close(paged_attention(*batch.args()), before)
