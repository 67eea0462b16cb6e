"""Gemma 3 (text) on the declared architecture (engine_svc/models/arch/gemma3.py): a tiny random
Gemma3ForCausalLM (fp32, seven layers: five sliding-window layers of 8 positions, one global, one
more local; q/k norms, GELU-tanh, sandwich (1 + w) norms, scaled embedding, tied head, final-logit
soft-capping) gives HF transformers' greedy tokens, chunked, batched and from cached prefixes; a
GGUF of it (written as llama.cpp's converter lays Gemma 3 out, read back by transformers' own GGUF
loader as the independent reader) gives the same; each request's result is bitwise its solo run;
the features not tested on it refuse it at start; and the native attention's window equals the
reference's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_helpers import (
    UNTESTED_FEATURES,
    check_gguf_reads_back,
    check_greedy_equals_hf,
    check_prefix_hits_and_preemption,
    check_refused_at_start,
    check_solo_runs,
    hf_reference_prompts,
    make_engine,
    random_model,
)

VOCAB = 1024  # prompts' ids; the model's vocabulary has 8 more (the GGUF's <mask> among them)
MAX_NEW = 10
WINDOW = 8
# Shorter and longer than the window, ending on and off block edges; two share a prefix.
LENGTHS = [1, 5, 8, 9, 17, 40]
GEMMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=7,  # the default pattern: layers 0-4 and 6 local, 5 global
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    query_pre_attn_scalar=16,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("gemma3")
    model_dir = random_model(
        root / "hf", trained_tokenizer_dir, "gemma3", seed=31, vocab_size=VOCAB + 8, **GEMMA
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts, refs = hf_reference_prompts(hf, LENGTHS, VOCAB, MAX_NEW)
    return model_dir, hf, prompts, refs


def _check(model, hf, prompts, refs, **options):
    return check_greedy_equals_hf(model, hf, prompts, refs, MAX_NEW, **options)


def test_the_declaration_reads_the_config(gemma):
    engine = make_engine(gemma[0])
    spec = engine.spec
    assert [a.window for a in spec.layer_attention] == [WINDOW] * 5 + [None, WINDOW]
    assert {a.rope_theta for a in spec.layer_attention} == {10_000.0, 1_000_000.0}
    assert (spec.activation, spec.norm_offset, spec.sandwich_norms) == ("gelu_tanh", 1.0, True)
    assert spec.embed_scale == 8.0 and spec.attn_scale == 0.25 and spec.final_logit_softcap == 30.0
    assert engine.max_model_len == 1024  # the model's context, not its window


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 7)])
def test_greedy_equals_hf_batched_and_chunked(gemma, block_size, budget):
    model_dir, hf, prompts, refs = gemma
    engine = _check(model_dir, hf, prompts, refs, block_size=block_size, max_num_batched_tokens=budget)
    assert engine.model.native_loop_reason is None  # the native one-call layer loop served it


def test_greedy_equals_hf_with_rotary_rows_made_a_few_positions_at_a_time(gemma, monkeypatch):
    """Both tables (local and global theta) grown 4 positions at a time as the steps reach them
    (engine_svc/models/rotary_tables.py): HF's tokens; rows past the longest sequence never made."""
    from engine_svc.models import rotary_tables

    monkeypatch.setattr(rotary_tables, "BLOCK", 4)
    model_dir, hf, prompts, refs = gemma
    engine = _check(model_dir, hf, prompts, refs, block_size=8, max_num_batched_tokens=7)
    longest = max(len(p) for p in prompts) + MAX_NEW - 1
    assert engine.model.rotary.covered == -(-longest // 4) * 4 < engine.max_model_len
    assert engine.model.num_rope_tables == 2 and not engine.model.cos_sin_1[longest + 4 :].any()


def test_greedy_equals_hf_with_prefix_hits(gemma):
    model_dir, hf, prompts, refs = gemma
    check_prefix_hits_and_preemption(model_dir, hf, prompts, refs, MAX_NEW, tight_blocks=None)


@pytest.fixture(scope="module")
def gemma_gguf(gemma, tmp_path_factory):
    from tests.gguf_files import write_gguf

    return write_gguf(gemma[0], tmp_path_factory.mktemp("gemma3_gguf") / "tiny-gemma3-f32.gguf", "F32")


def test_gguf_of_it_reads_back_in_transformers_and_gives_the_same_tokens(gemma, gemma_gguf):
    model_dir, hf, prompts, refs = gemma
    # transformers' GGUF loader, an independent reader of the file: HF's own weights back
    check_gguf_reads_back(hf, gemma_gguf)
    _check(gemma_gguf, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)


def test_requests_equal_their_solo_runs(gemma):
    check_solo_runs(
        gemma[0], required_extra=("window blocks released",), kv_groups=7
    )  # 1 full + 6 window groups


def test_the_triton_kernels_serve_both_rotary_kinds_and_the_qk_norms(gemma):
    """The Triton kernels (run by Triton's interpreter on CPU, fp32) give HF's greedy tokens: the
    local and the global layers' rotary tables, the q/k norms, the windows (released blocks in the
    window groups' tables), in chunks that straddle a window's edge and in decodes."""
    import triton.language  # noqa: F401  (imported first, as in a full run)

    from tests.triton_mode import interpreted_kernels

    model_dir, hf, prompts, refs = gemma
    # (the interpreter is slow: one prompt past the window, 17 + 10 tokens, chunked 16 + 1)
    one = LENGTHS.index(17)
    with interpreted_kernels():
        engine = _check(
            model_dir,
            hf,
            [prompts[one]],
            [refs[one]],
            kernel_backend="triton",
            block_size=8,
            max_num_batched_tokens=16,
        )
        assert engine.kernels.name == "triton"
        assert engine.kv.num_window_released > 0


@pytest.mark.parametrize("option,words", UNTESTED_FEATURES)
def test_untested_features_refuse_it_at_start(gemma, option, words):
    check_refused_at_start(gemma[0], "Gemma3ForCausalLM", option, words)


@pytest.mark.parametrize("window", [1, 3, 8, 21])
def test_native_attention_window_equals_the_reference(window):
    from kernels.cpu import native_attention
    from kernels.reference import paged_attention as reference

    if native_attention.library() is None:
        pytest.skip("no native attention build here (no C compiler)")
    torch.manual_seed(window)
    blocks, bs, hk, hq, d = 32, 4, 2, 4, 16
    k_cache, v_cache = torch.randn(blocks, bs, hk, d), torch.randn(blocks, bs, hk, d)
    # a decode of 30, a chunk of 9 over 25, a whole prompt of 6, a decode of 3
    q_lens, ctx = [1, 9, 6, 1], [30, 25, 6, 3]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = torch.randperm(blocks, dtype=torch.int32)[:32].view(4, 8)
    q = torch.randn(int(qsl[-1]), hq, d)
    lens = torch.tensor(ctx, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, lens, qsl, 0.3)
    got = native_attention.paged_attention(*args, window=window, isa=None)
    want = reference.paged_attention(*args, window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, reference.paged_attention(*args)) or window >= 30
    # a chunk's last row is bitwise the decode of the same token over the same context
    solo = native_attention.paged_attention(
        q[9:10],
        k_cache,
        v_cache,
        tables[1:2],
        lens[1:2],
        torch.tensor([0, 1], dtype=torch.int32),
        0.3,
        window=window,
    )
    assert torch.equal(solo[0], got[9])
