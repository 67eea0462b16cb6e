"""Gemma 2 on the declared architecture (engine_svc/models/arch/gemma2.py): a tiny random
Gemma2ForCausalLM (fp32, five layers alternating sliding-window (8 positions) and global,
GELU-tanh, sandwich (1 + w) norms, scaled embedding, an untied head, soft-capped attention scores
and final logits) gives HF transformers' greedy tokens (its eager attention, which applies the
score cap), chunked, batched, from cached prefixes and through preemptions; a GGUF of it
(llama.cpp's layout, read back by transformers' own GGUF loader as the independent reader) gives
the same; each request's result is bitwise its solo run; the untested features refuse it at
start; and the native attention's soft-cap equals the reference's, a chunk's row bitwise the
decode of the same token."""

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
    hf_greedy,
    hf_reference_prompts,
    make_engine,
    random_model,
)

VOCAB = 1024  # prompts' ids; the model's vocabulary has 8 more (the GGUF's <mask> among them)
MAX_NEW = 10
WINDOW = 8
ATTN_CAP = 2.0  # small, so that the cap changes this random model's tokens (checked below)
LENGTHS = [1, 5, 8, 9, 17, 40]
GEMMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,  # layers 0, 2, 4 local, 1 and 3 global
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=WINDOW,
    query_pre_attn_scalar=16,
    attn_logit_softcapping=ATTN_CAP,
    final_logit_softcapping=30.0,
    tie_word_embeddings=False,  # (tied, this random model repeats its last token)
)


def _hf(model_dir, **overrides):
    # eager: the attention that applies the score cap (SDPA would not)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="float32", attn_implementation="eager", **overrides
    ).eval()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("gemma2")
    model_dir = random_model(
        root / "hf", trained_tokenizer_dir, "gemma2", seed=23, vocab_size=VOCAB + 8, **GEMMA
    )
    hf = _hf(model_dir)
    prompts, refs = hf_reference_prompts(hf, LENGTHS, VOCAB, MAX_NEW)
    return model_dir, hf, prompts, refs


def _check(model, hf, prompts, refs, **options):
    return check_greedy_equals_hf(model, hf, prompts, refs, MAX_NEW, **options)


def test_the_declaration_reads_the_config(gemma):
    engine = make_engine(gemma[0])
    spec = engine.spec
    assert [a.window for a in spec.layer_attention] == [WINDOW, None] * 2 + [WINDOW]
    assert len({a.rope_key() for a in spec.layer_attention}) == 1  # one rotary table for both kinds
    assert (spec.activation, spec.norm_offset, spec.sandwich_norms, spec.qk_norm) == (
        "gelu_tanh",
        1.0,
        True,
        False,
    )
    assert spec.embed_scale == 8.0 and spec.attn_scale == 0.25
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (ATTN_CAP, 30.0)
    assert engine.max_model_len == 1024  # the model's context, not its window


def test_the_score_cap_changes_these_tokens(gemma):
    """Without the attention cap (the same weights) HF's tokens differ: an engine that ignored it
    fails the equality tests here."""
    model_dir, _, prompts, refs = gemma
    uncapped = _hf(model_dir, attn_logit_softcapping=None)
    assert any(hf_greedy(uncapped, p, MAX_NEW) != ref for p, ref in zip(prompts, refs, strict=True))


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 7)])
def test_greedy_equals_hf_batched_and_chunked(gemma, block_size, budget):
    model_dir, hf, prompts, refs = gemma
    engine = _check(model_dir, hf, prompts, refs, block_size=block_size, max_num_batched_tokens=budget)
    assert engine.model.native_loop_reason is None  # the native one-call layer loop served it


def test_greedy_equals_hf_with_prefix_hits_and_preemption(gemma):
    model_dir, hf, prompts, refs = gemma
    check_prefix_hits_and_preemption(model_dir, hf, prompts, refs, MAX_NEW, tight_blocks=40)


def test_python_layer_loop_and_reference_kernels_give_the_same_tokens(gemma):
    """The soft-cap on the other paths: the Python layer loop over the native attention, and the
    reference kernels (the torch twin's arithmetic written out)."""
    import os

    model_dir, hf, prompts, refs = gemma
    os.environ["LLMSERVE_NATIVE_DECODER_LOOP"] = "0"
    try:
        _check(model_dir, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)
    finally:
        del os.environ["LLMSERVE_NATIVE_DECODER_LOOP"]
    _check(model_dir, hf, prompts, refs, block_size=8, max_num_batched_tokens=16, kernel_backend="reference")


@pytest.fixture(scope="module")
def gemma_gguf(gemma, tmp_path_factory):
    from tests.gguf_files import write_gguf

    return write_gguf(gemma[0], tmp_path_factory.mktemp("gemma2_gguf") / "tiny-gemma2-f32.gguf", "F32")


def test_gguf_of_it_reads_back_in_transformers_and_gives_the_same_tokens(gemma, gemma_gguf):
    model_dir, hf, prompts, refs = gemma
    from gguf import GGUFReader

    check_gguf_reads_back(hf, gemma_gguf, skip=("lm_head.weight",))
    # transformers' GGUF loader ties Gemma 2's head (it reads no output.weight): the untied head
    # read back with the gguf package's reader alone
    head = next(t for t in GGUFReader(str(gemma_gguf)).tensors if t.name == "output.weight")
    assert torch.equal(torch.from_numpy(head.data.copy()), hf.lm_head.weight)
    engine = _check(gemma_gguf, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)
    assert engine.spec.attn_logit_softcap == ATTN_CAP  # from the file's metadata


def window_hit_mix():
    """A mix Hypothesis drew in one test order only (its derandomized draws depend on what the
    process imported): preemptions in a pool of 8 blocks a group, a fork of three greedy samples,
    prefix hits. A resumed sample's hit took a window page that an earlier group's allocation of
    the same call had just evicted and taken (kv_cache_manager: the hit pages are now taken first);
    its third sample diverged from its solo run at token 15."""
    from engine_svc import SamplingParams
    from tests.test_batch_invariance import Spec

    prompt = [701, 131, 3, 1022, 341, 3, 311, 3, 369, 294, 3, 3, 3, 234, 1016, 129, 106]
    greedy = dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)
    specs = [
        Spec(prompt, SamplingParams(n=3, max_tokens=21, min_tokens=3, **greedy), 0, 1, None, None),
        Spec(
            prompt + [3, 3],
            SamplingParams(max_tokens=15, min_tokens=3, stop_token_ids=[3], prompt_logprobs=2, **greedy),
            *(0, 1, None, None),
        ),
        Spec([3] * 12, SamplingParams(max_tokens=1, stop_token_ids=[3], **greedy), 0, 0, None, None),
        Spec(prompt, SamplingParams(max_tokens=1, stop_token_ids=[3], **greedy), 0, 0, None, None),
    ]
    config = dict(
        block_size=8,
        max_num_batched_tokens=16,
        scheduling_policy="fcfs",
        speculative_config=None,
        num_kv_blocks=8,
        _slack=0,
        max_seqs_per_step=None,
    )
    return specs, config


def test_requests_equal_their_solo_runs(gemma):
    check_solo_runs(
        gemma[0], required_extra=("window blocks released",), kv_groups=5, explicit=[window_hit_mix()]
    )  # 2 full + 3 window groups of one layer


@pytest.mark.parametrize("option,words", UNTESTED_FEATURES)
def test_untested_features_refuse_it_at_start(gemma, option, words):
    check_refused_at_start(gemma[0], "Gemma2ForCausalLM", option, words)


def test_the_triton_kernels_serve_windows_and_capped_scores(gemma):
    """The Triton kernels (run by Triton's interpreter on CPU) give HF's greedy tokens: the window
    layers' and the cap through the varlen kernel, in chunks whose tiles straddle the window's
    edge and in decodes, with the window groups' released blocks (null entries) in their tables."""
    import triton.language  # noqa: F401  (imported first, as in a full run)

    from tests.triton_mode import interpreted_kernels

    model_dir, hf, prompts, refs = gemma
    longer = [i for i, n in enumerate(LENGTHS) if n > WINDOW]  # (the interpreter is slow: these only)
    with interpreted_kernels():
        engine = _check(
            model_dir,
            hf,
            [prompts[i] for i in longer],
            [refs[i] for i in longer],
            kernel_backend="triton",
            block_size=8,
            max_num_batched_tokens=16,
        )
        assert engine.kernels.name == "triton"
        assert engine.kv.num_window_released > 0


@pytest.mark.parametrize("window,cap", [(None, 2.0), (5, 0.5), (None, 50.0)])
def test_native_attention_softcap_equals_the_reference(window, cap):
    from kernels.cpu import native_attention
    from kernels.reference import paged_attention as reference

    if native_attention.library() is None:
        pytest.skip("no native attention build here (no C compiler)")
    torch.manual_seed(int(cap * 10))
    blocks, bs, hk, hq, d = 32, 4, 2, 4, 16
    k_cache, v_cache = torch.randn(blocks, bs, hk, d), torch.randn(blocks, bs, hk, d)
    q_lens, ctx = [1, 9, 6, 1], [30, 25, 6, 3]  # decodes, a chunk over a cached prefix, a prompt
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = torch.randperm(blocks, dtype=torch.int32)[:32].view(4, 8)
    q = torch.randn(int(qsl[-1]), hq, d) * 3
    lens = torch.tensor(ctx, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, lens, qsl, 0.3)
    got = native_attention.paged_attention(*args, window=window, softcap=cap, isa=None)
    want = reference.paged_attention(*args, window=window, softcap=cap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if cap < 10:  # a cap that bites changes the result
        assert not torch.allclose(want, reference.paged_attention(*args, window=window), atol=1e-3)
    # a chunk's last row is bitwise the decode of the same token over the same context
    solo = native_attention.paged_attention(
        q[9:10], k_cache, v_cache, tables[1:2], lens[1:2], torch.tensor([0, 1], dtype=torch.int32), 0.3,
        window=window, softcap=cap,
    )  # fmt: skip
    assert torch.equal(solo[0], got[9])
