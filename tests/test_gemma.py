"""Gemma (the first) on the declared architecture (engine_svc/models/arch/gemma.py, the one file
added for it besides this one): a tiny random GemmaForCausalLM (fp32; GELU-tanh, (1 + w) norms,
the embedding scaled by sqrt(hidden), a tied head, every layer full attention) gives HF
transformers' greedy tokens, chunked, batched, from cached prefixes, through preemptions, on the
native layer loop and the Python one; a GGUF of it (llama.cpp's ``gemma`` layout: Llama's names,
q/k rows as HF has them, the norms stored as 1 + w, no output tensor) gives the same tokens, its
tensors those of a ``llama`` file that transformers' own GGUF loader reads back to HF's weights
(transformers has no ``gemma`` GGUF reader); each request's result is bitwise its solo run; and
the untested engine features refuse it at start."""

from __future__ import annotations

import json

import numpy as np
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
)

VOCAB = 1024  # prompts' ids; the model's vocabulary has 8 more (the GGUF's <mask> among them)
MAX_NEW = 10
LENGTHS = [1, 5, 8, 9, 17, 40]
GEMMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,  # (Gemma's: the head is the embedding)
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("gemma")
    model_dir = random_model(
        root / "hf", trained_tokenizer_dir, "gemma", seed=47, vocab_size=VOCAB + 8, **GEMMA
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    assert type(hf).__name__ == "GemmaForCausalLM" and hf.config.hidden_act == "gelu_pytorch_tanh"
    # (1 + w) norms of zeros at init: random ones, so that a norm read as w (not 1 + w) shows
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(model_dir)
    prompts, refs = hf_reference_prompts(hf, LENGTHS, VOCAB, MAX_NEW)
    return model_dir, hf, prompts, refs


def _check(model, hf, prompts, refs, **options):
    return check_greedy_equals_hf(model, hf, prompts, refs, MAX_NEW, **options)


def test_the_declaration_reads_the_config(gemma):
    spec = ModelSpec.from_path(gemma[0])
    assert spec.architecture == "GemmaForCausalLM"
    assert (spec.activation, spec.norm_offset, spec.sandwich_norms) == ("gelu_tanh", 1.0, False)
    assert spec.embed_scale == 8.0 and spec.head_dim == 16
    assert spec.attn_scale in (None, 0.25) and spec.final_logit_softcap is None
    assert {(a.window, a.rope_theta, a.rope_scaling) for a in spec.layer_attention} == {(None, 10000.0, None)}
    cfg = json.loads((gemma[0] / "config.json").read_text())
    assert ModelSpec.from_dict({**cfg, "hidden_act": "gelu"}).activation == "gelu_tanh"  # (legacy name)
    with pytest.raises(ValueError, match="hidden_act 'silu' is not supported"):
        ModelSpec.from_dict({**cfg, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelSpec.from_dict({**cfg, "use_bidirectional_attention": True})


def test_gemmas_parts_change_these_tokens(gemma):
    """HF with SiLU in place of GELU-tanh (the same weights) gives other tokens: an engine that
    missed the declaration's activation fails the equality tests here (the norms' 1 + w and the
    embedding's scale are as decisive: the weights are random)."""
    model_dir, _, prompts, refs = gemma
    silu = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", hidden_act="silu").eval()
    assert any(hf_greedy(silu, p, MAX_NEW) != ref for p, ref in zip(prompts, refs, strict=True))


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 7)])
def test_greedy_equals_hf_batched_and_chunked(gemma, block_size, budget):
    model_dir, hf, prompts, refs = gemma
    engine = _check(model_dir, hf, prompts, refs, block_size=block_size, max_num_batched_tokens=budget)
    assert engine.model.native_loop_reason is None  # the native one-call layer loop served it


def test_greedy_equals_hf_with_prefix_hits_preemption_and_the_python_loop(gemma, monkeypatch):
    model_dir, hf, prompts, refs = gemma
    check_prefix_hits_and_preemption(model_dir, hf, prompts, refs, MAX_NEW)
    monkeypatch.setenv("LLMSERVE_NATIVE_DECODER_LOOP", "0")  # the Python layer loop
    _check(model_dir, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def gemma_gguf(gemma, tmp_path_factory):
    from tests.gguf_files import write_gguf

    return write_gguf(gemma[0], tmp_path_factory.mktemp("gemma_gguf") / "tiny-gemma-f32.gguf", "F32")


def test_gguf_of_it_gives_hfs_tokens(gemma, gemma_gguf, tmp_path):
    """The file is llama.cpp's ``gemma`` layout: a ``llama`` file's tensors (which transformers'
    GGUF loader reads back to HF's weights) with the q/k rows not permuted and the norms + 1; and
    the engine serves it = HF."""
    from gguf import GGUFReader

    from tests.gguf_files import permute_rows, write_gguf

    model_dir, hf, prompts, refs = gemma
    as_llama = write_gguf(model_dir, tmp_path / "tiny-as-llama-f32.gguf", "F32", arch="llama")
    ours, theirs = GGUFReader(gemma_gguf), GGUFReader(as_llama)
    assert ours.fields["general.architecture"].contents() == "gemma"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert "output.weight" not in [t.name for t in ours.tensors]  # the tied head
    heads = {"attn_q": GEMMA["num_attention_heads"], "attn_k": GEMMA["num_key_value_heads"]}
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        kind = a.name.split(".")[-2]
        if kind in heads:
            assert np.array_equal(permute_rows(np.array(a.data), heads[kind]), b.data), a.name
        elif a.name.endswith("norm.weight"):
            assert np.array_equal(a.data, np.array(b.data) + np.float32(1.0)), a.name
        else:
            assert np.array_equal(a.data, b.data), a.name
    check_gguf_reads_back(hf, as_llama)
    spec = ModelSpec.from_path(gemma_gguf)
    assert spec.architecture == "GemmaForCausalLM" and spec.norm_offset == 1.0 and spec.embed_scale == 8.0
    _check(gemma_gguf, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)


def test_its_gguf_tokenizer_converts_as_the_models_own(gemma, gemma_gguf, tmp_path, monkeypatch):
    """transformers' GGUF reader has no ``gemma`` config: the generic backend converts the file's
    tokenizer, which encodes as the model's own."""
    from tokenizers import Tokenizer

    from tokenizer_svc.tokenizer_files import gguf_tokenizer_dir

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    text = "def main():\n    return sorted(x for x in range(10) if x % 3) # ünïcode, 漢字"
    ids = [
        Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
        for d in (gemma[0], gguf_tokenizer_dir(gemma_gguf))
    ]
    assert ids[0] == ids[1] and len(ids[0]) > 10


def test_q8_0_file_serves_its_linears_from_their_blocks(gemma, tmp_path):
    check_q8_0_blocks(gemma[0], gemma[2], MAX_NEW, tmp_path / "tiny-gemma-q8_0.gguf")


def test_requests_equal_their_solo_runs(gemma):
    check_solo_runs(gemma[0])


@pytest.mark.parametrize("option,words", UNTESTED_FEATURES)
def test_untested_features_refuse_it_at_start(gemma, option, words):
    check_refused_at_start(gemma[0], "GemmaForCausalLM", option, words)
