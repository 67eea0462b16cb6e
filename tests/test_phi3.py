"""Phi-3 on the declared architecture (engine_svc/models/arch/phi3.py): a tiny random
Phi3ForCausalLM (fp32, three layers, fused qkv_proj and gate_up_proj) gives HF transformers' greedy
tokens, chunked, batched, from cached prefixes and through preemptions; the fused tensors land in
the decoder's slots as HF splits them; a GGUF of it (llama.cpp's layout: attn_qkv and ffn_up fused,
read back by transformers' own GGUF loader as the independent reader) gives the same, in F32 and
from its Q8_0 blocks; each request's result is bitwise its solo run; bad long-rope and partial
rotary configs and the untested engine features refuse it at start. Long-rope (a model whose
original length is 32 of 256) gives HF ``generate``'s tokens within, across and past the switch,
from HF files and a long-rope GGUF."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc.models.spec import ModelSpec
from tests.engine_helpers import (
    UNTESTED_FEATURES,
    check_gguf_reads_back,
    check_greedy_equals_hf,
    check_prefix_hits_and_preemption,
    check_q8_0_blocks,
    check_refused_at_start,
    check_solo_runs,
    hf_greedy,
    hf_reference_prompts,
    random_model,
    random_prompts,
)

VOCAB = 1024
MAX_NEW = 10
LENGTHS = [1, 5, 8, 9, 17, 40]
PHI3 = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("phi3")
    model_dir = random_model(root / "hf", trained_tokenizer_dir, "phi3", seed=41, vocab_size=VOCAB, **PHI3)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts, refs = hf_reference_prompts(hf, LENGTHS, VOCAB, MAX_NEW)
    return model_dir, hf, prompts, refs


def _check(model, hf, prompts, refs, **options):
    return check_greedy_equals_hf(model, hf, prompts, refs, MAX_NEW, **options)


def test_fused_tensors_are_split_into_the_decoders_slots(phi3):
    from engine_svc.models.decoder import DecoderForCausalLM
    from engine_svc.models.loader import load_weights

    model_dir, hf, _, _ = phi3
    spec = ModelSpec.from_path(model_dir)
    assert spec.architecture == "Phi3ForCausalLM"
    model = DecoderForCausalLM(spec, torch.float32, 64)
    load_weights(model, model_dir)  # the loader alone: the parameters as placed, before any packing
    for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
        # q, k, v rows in HF's order (Phi3Attention slices them so)
        assert torch.equal(ours.qkv_weight, theirs.self_attn.qkv_proj.weight)
        gate, up = theirs.mlp.gate_up_proj.weight.chunk(2, dim=0)  # HF: gate first, then up
        assert torch.equal(ours.gate_up_weight[: PHI3["intermediate_size"]], gate)
        assert torch.equal(ours.gate_up_weight[PHI3["intermediate_size"] :], up)


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 7)])
def test_greedy_equals_hf_batched_and_chunked(phi3, block_size, budget):
    model_dir, hf, prompts, refs = phi3
    engine = _check(model_dir, hf, prompts, refs, block_size=block_size, max_num_batched_tokens=budget)
    assert engine.model.native_loop_reason is None  # the native one-call layer loop served it


def test_greedy_equals_hf_with_prefix_hits_and_preemption(phi3):
    model_dir, hf, prompts, refs = phi3
    check_prefix_hits_and_preemption(model_dir, hf, prompts, refs, MAX_NEW)


@pytest.fixture(scope="module")
def phi3_gguf(phi3, tmp_path_factory):
    from tests.gguf_files import write_gguf

    return write_gguf(phi3[0], tmp_path_factory.mktemp("phi3_gguf") / "tiny-phi3-f32.gguf", "F32")


def test_gguf_of_it_reads_back_in_transformers_and_gives_the_same_tokens(phi3, phi3_gguf):
    model_dir, hf, prompts, refs = phi3
    # (Phi3Config's default pad id, 32000, is outside the tiny vocabulary: named here)
    check_gguf_reads_back(hf, phi3_gguf, pad_token_id=0)
    _check(phi3_gguf, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)


def test_q8_0_file_serves_the_fused_tensors_from_their_blocks(phi3, tmp_path):
    """The fused attn_qkv and ffn_up blocks are the decoder's qkv and gate/up linears as they are
    (the weight map names one tensor for each), bit-equal to the dequantized file's fp32 GEMMs."""
    blocks, floats = check_q8_0_blocks(phi3[0], phi3[2], MAX_NEW, tmp_path / "tiny-phi3-q8_0.gguf")
    for a, b in zip(blocks.model.layers, floats.model.layers, strict=True):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert getattr(a, name).fmt == "Q8_0", name
            inp = torch.randn(9, getattr(a, name).in_features)
            assert torch.equal(getattr(a, name)(inp), getattr(b, name)(inp)), name


def test_requests_equal_their_solo_runs(phi3):
    check_solo_runs(phi3[0])


@pytest.mark.parametrize(
    "change,words",
    [
        (
            {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7}},
            "long_factor must list 8 factors",
        ),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "short_factor must list 8"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_bad_long_rope_and_partial_rotary_refuse_naming_the_field(phi3, change, words):
    cfg = {**json.loads((phi3[0] / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=words):
        ModelSpec.from_dict(cfg)


# --- long-context rotary (longrope): a tiny model whose original length is 32 of 256 ------------
ORIGINAL = 32
LONG_ROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}
LONG_NEW = 14  # prompts of 20..31 tokens cross the original length while generating


def hf_each_position_its_table(hf, prompt: list[int], max_new: int) -> list[int]:
    """HF's own model and cache, fed so that no forward re-rotates a cached key: the prompt's first
    ORIGINAL tokens in one forward (the short factors), the rest and the generated tokens one a
    forward (each past the original length: the long factors). The rule served before the switch
    recomputed a sequence; ``generate`` differs from it."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt[:ORIGINAL]]), use_cache=True)
        for token in prompt[ORIGINAL:]:
            out = hf(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        tokens = []
        for _ in range(max_new):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("phi3_long")
    model_dir = random_model(
        root / "hf",
        trained_tokenizer_dir,
        "phi3",
        seed=47,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=LONG_ROPE,
        **PHI3,
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts = random_prompts([1, 9, 20, 25, 31, 40, 57], VOCAB, seed=8)  # within, across, past it
    prompts.append(prompts[3][:16] + random_prompts([12], VOCAB, seed=9)[0])  # a prefix hit
    # HF's generate: Phi-3 drops its cache at the step whose input passes the original length
    # and computes the whole sequence again with the long factors
    return model_dir, hf, prompts, [hf_greedy(hf, p, LONG_NEW) for p in prompts]


def test_long_rope_table_equals_hfs_rotary_on_both_sides_of_the_switch(phi3_long):
    from kernels.reference.rotary import rope_table

    model_dir, hf, _, _ = phi3_long
    spec = ModelSpec.from_path(model_dir)
    kind = spec.layer_attention[0]
    assert kind.rope_switch == spec.rope_switch == ORIGINAL
    assert kind.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(8) / math.log(32)) ** 0.5)
    ours = rope_table(spec.head_dim, kind.rope_theta, kind.rope_scaling, 256)
    assert ours.shape == (2 * 256, 16)
    rotary, x = hf.model.rotary_emb, torch.zeros(1, 1, 16)
    with torch.no_grad():  # a forward reaching the original length: the short factors (rows 0..)
        cos, sin = rotary(x, torch.arange(ORIGINAL)[None])
        assert torch.equal(ours[:ORIGINAL, :8], cos[0, :, :8]) and torch.equal(
            ours[:ORIGINAL, 8:], sin[0, :, :8]
        )
        # a forward reaching past it: the long factors at every position (rows 256..)
        cos, sin = rotary(x, torch.arange(256)[None])
        assert torch.equal(ours[256:, :8], cos[0, :, :8]) and torch.equal(ours[256:, 8:], sin[0, :, :8])


def test_the_long_factors_and_the_recompute_change_these_tokens(phi3_long):
    """HF with the short factors in place of the long ones gives other tokens (an engine that never
    switched fails the equality tests below), and so does each position rotated by its own table
    with no recompute (the rule served before: an engine that does not compute a crossing
    sequence again fails them too)."""
    model_dir, hf, prompts, refs = phi3_long
    params = {
        **LONG_ROPE,
        "long_factor": LONG_ROPE["short_factor"],
        "original_max_position_embeddings": ORIGINAL,
    }
    never = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", rope_parameters=params).eval()
    assert any(hf_greedy(never, p, LONG_NEW) != ref for p, ref in zip(prompts, refs, strict=True))
    crossing = [i for i, p in enumerate(prompts) if len(p) <= ORIGINAL < len(p) + LONG_NEW - 1]
    assert crossing and any(hf_each_position_its_table(hf, prompts[i], LONG_NEW) != refs[i] for i in crossing)


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 7)])
def test_long_rope_greedy_equals_hf_on_both_sides_of_the_switch(phi3_long, block_size, budget):
    """Prompts within the original length, crossing it while generating (each computed again with
    the long factors at the crossing), and longer than it: chunked, batched, a prefix hit."""
    model_dir, hf, prompts, refs = phi3_long
    engine = check_greedy_equals_hf(
        model_dir, hf, prompts, refs, LONG_NEW, block_size=block_size, max_num_batched_tokens=budget
    )
    assert engine.model.native_loop_reason is None
    crossing = sum(len(p) <= ORIGINAL < len(p) + LONG_NEW - 1 for p in prompts)
    assert engine.scheduler.num_rope_recomputes == crossing


def test_long_rope_greedy_equals_hf_with_rotary_rows_made_a_few_positions_at_a_time(phi3_long, monkeypatch):
    """Both phases' rows grown 4 positions at a time as the steps reach them
    (engine_svc/models/rotary_tables.py), across the switch: HF's tokens."""
    from engine_svc.models import rotary_tables

    monkeypatch.setattr(rotary_tables, "BLOCK", 4)
    model_dir, hf, prompts, refs = phi3_long
    engine = check_greedy_equals_hf(
        model_dir, hf, prompts, refs, LONG_NEW, block_size=8, max_num_batched_tokens=7
    )
    assert 0 < engine.model.rotary.covered < engine.max_model_len


def test_long_rope_through_preemption_and_prefix_hits(phi3_long):
    """Run twice in one engine: the second run's prefix hits find the blocks of their own table
    only (a short-table block is never served to a sequence past the switch, nor the reverse)."""
    model_dir, hf, prompts, refs = phi3_long
    check_prefix_hits_and_preemption(model_dir, hf, prompts, refs, LONG_NEW, tight_blocks=16)


def test_the_kv_manager_keeps_each_tables_blocks_apart_and_asks_for_the_recompute():
    """With a switch of 8 tokens (blocks of 4): a sequence's blocks are hashed under its phase, so
    a sequence past the switch finds none of a short one's blocks (same tokens) and the reverse; a
    running sequence that grows past the switch needs its blocks computed again, and once released
    its next lookup finds the long blocks another sequence computed."""
    from engine_svc.block_hash import prompt_block_hashes
    from engine_svc.kv_cache_manager import KVCacheManager
    from engine_svc.sampling_params import SamplingParams
    from engine_svc.sequence import Request, Sequence

    def seq(tokens, i):
        request = Request(f"r{i}", list(tokens), SamplingParams(max_tokens=100), 0, None, i, 100)
        return Sequence(request, 0, list(tokens))

    def compute(kv, s):
        n = len(s.token_ids) - s.num_computed_tokens
        assert kv.allocate(s, n)
        kv.register_computed_blocks(s, scheduled=n)
        s.num_computed_tokens += n

    kv = KVCacheManager(32, 4, True, rope_switch=8)
    tokens = list(range(100, 112))
    short, long = seq(tokens[:8], 0), seq(tokens, 1)  # 8 tokens: the short table; 12: the long
    compute(kv, short)
    assert kv.find_cached_prefix(long) == []  # its first 8 tokens are short's, but not its table's
    compute(kv, long)
    assert kv.block_hashes(long, 3) == prompt_block_hashes(tokens, 4, rope_phase=1)
    assert kv.block_hashes(short, 2) == prompt_block_hashes(tokens[:8], 4)
    assert len(kv.find_cached_prefix(seq(tokens[:7], 2))) == 1  # a short one finds short's
    assert not kv.needs_recompute(short)
    short.token_ids.append(tokens[8])  # a sampled token: 9 > 8, the long table now
    assert kv.needs_recompute(short) and not kv.needs_recompute(long)
    kv.free(short)
    short.num_computed_tokens = 0
    assert len(kv.find_cached_prefix(short)) == 2  # long's blocks (tokens 0..7 of the long table)


def test_long_rope_gguf_serves_its_factors_as_hf(phi3_long, tmp_path):
    """A long-rope GGUF as llama.cpp's converter writes it (``rope_factors_long/short`` tensors, the
    original length and attention factor in its metadata): gguf's own reader finds the factors as
    written, the tables equal the HF config's bit for bit, and the file gives HF's tokens for a
    prompt that crosses the original length and one past it."""
    from gguf import GGUFReader

    from kernels.reference.rotary import rope_table
    from tests.gguf_files import write_gguf

    model_dir, hf, prompts, refs = phi3_long
    path = write_gguf(model_dir, tmp_path / "tiny-phi3-long-f32.gguf", "F32")
    tensors = {t.name: t.data for t in GGUFReader(path).tensors}
    for name in ("short", "long"):
        assert tensors[f"rope_factors_{name}.weight"].tolist() == pytest.approx(LONG_ROPE[f"{name}_factor"])
    ours, theirs = ModelSpec.from_path(path), ModelSpec.from_path(model_dir)
    assert ours.rope_switch == ORIGINAL and ours.max_position_embeddings == 256
    a, b = ours.layer_attention[0], theirs.layer_attention[0]
    assert torch.equal(
        rope_table(16, a.rope_theta, a.rope_scaling, 256), rope_table(16, b.rope_theta, b.rope_scaling, 256)
    )
    pick = [2, 5]  # 20 tokens (crosses while generating), 40 (past it)
    engine = check_greedy_equals_hf(
        path,
        hf,
        [prompts[i] for i in pick],
        [refs[i] for i in pick],
        LONG_NEW,
        block_size=8,
        max_num_batched_tokens=16,
    )
    assert engine.scheduler.num_rope_recomputes == 1


def test_long_rope_requests_equal_their_solo_runs(phi3_long):
    from tests.test_batch_invariance import EXAMPLES, explore

    required = ("chunked prefills", "prefix-hit tokens", "general steps", "preemptions")
    extra = {"speculative_config": None, "max_num_batched_tokens": 16}
    explore(phi3_long[0], max(8, EXAMPLES // 4), extra, required)


@pytest.mark.parametrize("option,words", UNTESTED_FEATURES)
def test_untested_features_refuse_it_at_start(phi3, option, words):
    check_refused_at_start(phi3[0], "Phi3ForCausalLM", option, words)
