"""SmolLM3 on the declared architecture (engine_svc/models/arch/smollm3.py): a tiny random
SmolLM3ForCausalLM (fp32, four layers, the fourth without rotary: NoPE) gives HF transformers'
greedy tokens, chunked, batched, from cached prefixes and through preemptions, on the native layer
loop and on the Python one; without NoPE HF's tokens differ (so these tests fail if the engine
rotated that layer); a GGUF of it (llama.cpp's ``smollm3`` layout: Llama's tensors, q/k rows
permuted) gives the same tokens, and its tensors are those of a ``llama`` file that transformers'
own GGUF loader reads back to HF's weights (transformers has no SmolLM3 GGUF reader); each
request's result is bitwise its solo run; and the untested engine features refuse it at start."""

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

VOCAB = 1024
MAX_NEW = 10
LENGTHS = [1, 5, 8, 9, 17, 40]
SMOLLM3 = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # transformers' default no_rope_layers: [1, 1, 1, 0]
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,  # (tied, a tiny random model tends to repeat its last token)
)


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("smollm3")
    model_dir = random_model(
        root / "hf", trained_tokenizer_dir, "smollm3", seed=43, vocab_size=VOCAB, **SMOLLM3
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    assert hf.config.no_rope_layers == [1, 1, 1, 0]
    prompts, refs = hf_reference_prompts(hf, LENGTHS, VOCAB, MAX_NEW)
    return model_dir, hf, prompts, refs


def _check(model, hf, prompts, refs, **options):
    return check_greedy_equals_hf(model, hf, prompts, refs, MAX_NEW, **options)


def test_the_declaration_reads_the_config(smollm3):
    spec = ModelSpec.from_path(smollm3[0])
    assert spec.architecture == "SmolLM3ForCausalLM"
    kinds = [a.rope_scaling for a in spec.layer_attention]
    assert kinds == [None, None, None, {"rope_type": "none"}]
    assert all(a.window is None for a in spec.layer_attention)
    cfg = json.loads((smollm3[0] / "config.json").read_text())
    windowed = {
        **cfg,
        "no_rope_layers": [0, 1, 1, 0],
        "use_sliding_window": True,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
    }
    spec = ModelSpec.from_dict(windowed)
    assert [a.window for a in spec.layer_attention] == [6, None, None, 6]
    assert [a.rope_scaling for a in spec.layer_attention] == [
        {"rope_type": "none"},
        None,
        None,
        {"rope_type": "none"},
    ]
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries"):
        ModelSpec.from_dict({**cfg, "no_rope_layers": [1, 1, 0]})
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelSpec.from_dict({**cfg, "mlp_bias": True})


def test_the_nope_layer_changes_these_tokens(smollm3):
    """HF with rotary on every layer (the same weights) gives other tokens: an engine that rotated
    the NoPE layer fails the equality tests here."""
    model_dir, _, prompts, refs = smollm3
    roped = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", no_rope_layers=[1] * 4).eval()
    assert any(hf_greedy(roped, p, MAX_NEW) != ref for p, ref in zip(prompts, refs, strict=True))


def test_the_identity_table_leaves_q_and_k_bit_for_bit():
    from kernels.reference.rotary import apply_rotary, rope_cos_sin_cache, rope_inv_freq

    table = rope_cos_sin_cache(rope_inv_freq(16, 1e4, {"rope_type": "none"}), 100)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    rq, rk = apply_rotary(torch.tensor([0, 1, 5, 17, 40, 63, 99]), q, k, table)
    assert torch.equal(rq, q) and torch.equal(rk, k)


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 7)])
def test_greedy_equals_hf_batched_and_chunked(smollm3, block_size, budget):
    model_dir, hf, prompts, refs = smollm3
    engine = _check(model_dir, hf, prompts, refs, block_size=block_size, max_num_batched_tokens=budget)
    assert engine.model.native_loop_reason is None  # the native one-call layer loop served it
    assert engine.model.num_rope_tables == 2  # the rotary table and the NoPE layer's identity


def test_greedy_equals_hf_with_prefix_hits_preemption_and_the_python_loop(smollm3, monkeypatch):
    model_dir, hf, prompts, refs = smollm3
    check_prefix_hits_and_preemption(model_dir, hf, prompts, refs, MAX_NEW)
    monkeypatch.setenv("LLMSERVE_NATIVE_DECODER_LOOP", "0")  # the Python layer loop
    _check(model_dir, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def smollm3_gguf(smollm3, tmp_path_factory):
    from tests.gguf_files import write_gguf

    return write_gguf(smollm3[0], tmp_path_factory.mktemp("smollm3_gguf") / "tiny-smollm3-f32.gguf", "F32")


def test_gguf_of_it_gives_hfs_tokens(smollm3, smollm3_gguf, tmp_path):
    """The file's tensors are byte for byte a Llama file's (same names, q/k rows permuted alike),
    which transformers' GGUF loader reads back to HF's weights; and the engine serves it = HF."""
    from gguf import GGUFReader

    from tests.gguf_files import write_gguf

    model_dir, hf, prompts, refs = smollm3
    as_llama = write_gguf(model_dir, tmp_path / "tiny-as-llama-f32.gguf", "F32", arch="llama")
    ours, theirs = GGUFReader(smollm3_gguf), GGUFReader(as_llama)
    assert ours.fields["general.architecture"].contents() == "smollm3"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(a.data, b.data), a.name
    check_gguf_reads_back(hf, as_llama)
    spec = ModelSpec.from_path(smollm3_gguf)
    assert [a.rope_scaling for a in spec.layer_attention] == [None, None, None, {"rope_type": "none"}]
    _check(smollm3_gguf, hf, prompts, refs, block_size=8, max_num_batched_tokens=16)


def test_its_gguf_tokenizer_converts_like_a_llama_files(smollm3, smollm3_gguf, tmp_path, monkeypatch):
    """transformers' GGUF reader has no SmolLM3 config, so the tokenizer metadata is converted by
    the generic backend: it encodes as the model's own tokenizer and as the Llama file's."""
    from tokenizers import Tokenizer

    from tests.gguf_files import write_gguf
    from tokenizer_svc.tokenizer_files import gguf_tokenizer_dir

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    as_llama = write_gguf(smollm3[0], tmp_path / "tiny-as-llama-f32.gguf", "F32", arch="llama")
    text = "def main():\n    return sorted(x for x in range(10) if x % 3) # ünïcode, 漢字"
    ids = [
        Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
        for d in (smollm3[0], gguf_tokenizer_dir(smollm3_gguf), gguf_tokenizer_dir(as_llama))
    ]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) > 10


def test_requests_equal_their_solo_runs(smollm3):
    check_solo_runs(smollm3[0])


@pytest.mark.parametrize("option,words", UNTESTED_FEATURES)
def test_untested_features_refuse_it_at_start(smollm3, option, words):
    check_refused_at_start(smollm3[0], "SmolLM3ForCausalLM", option, words)


def test_q8_0_file_serves_its_linears_from_their_blocks(smollm3, tmp_path):
    check_q8_0_blocks(smollm3[0], smollm3[2], MAX_NEW, tmp_path / "tiny-smollm3-q8_0.gguf")
