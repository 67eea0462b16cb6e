"""Checkpoint variants load and stay token-exact with HF: sharded safetensors, tied embeddings,
llama3 rope scaling; and KV cache sizing from a byte budget."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from engine_svc import SamplingParams
from engine_svc.models.build import build_random_model
from tests.engine_helpers import (
    assert_greedy_matches,
    hf_greedy,
    make_engine,
    random_prompts,
    run_to_completion,
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=1024,
    max_position_embeddings=512,
)


def _compare(model_dir, block_size=16):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts = random_prompts([3, 30, 77], 1024, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = run_to_completion(
        make_engine(model_dir, block_size=block_size, max_num_batched_tokens=20),
        {str(i): (p, params) for i, p in enumerate(prompts)},
    )
    for i, p in enumerate(prompts):
        assert_greedy_matches(hf, p, out[(str(i), 0)], hf_greedy(hf, p, 10))


def test_sharded_checkpoint_with_tied_embeddings(tmp_path):
    d = build_random_model(tmp_path / "m", "llama", seed=5, tie_word_embeddings=True, **SHAPE)
    # Re-save in shards so the loader must follow model.safetensors.index.json.
    hf = AutoModelForCausalLM.from_pretrained(d)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("generation_config.json",):
        (sharded / f).write_text((d / f).read_text())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]
    _compare(sharded)


def test_llama3_rope_scaling(tmp_path):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    }
    d = build_random_model(tmp_path / "m", "llama", seed=6, rope_parameters=rope, **SHAPE)
    engine = make_engine(d)
    from kernels.reference.rotary import rope_inv_freq

    default = rope_inv_freq(16, 500000.0)
    assert not torch.equal(rope_inv_freq(16, 500000.0, engine.spec.rope_scaling), default)
    _compare(d, block_size=8)


def test_kv_cache_sized_from_a_byte_budget(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=None, kv_cache_memory=1 << 20, block_size=16)
    spec = engine.spec
    per_block = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4 * 16
    assert engine.stats().kv_blocks_total == (1 << 20) // per_block


def test_a_kv_budget_too_small_for_one_block_is_refused_naming_it(tiny_llama):
    import pytest

    refused = r"the KV budget, kv_cache_memory 100 bytes, holds no block of \d+ bytes"
    with pytest.raises(ValueError, match=refused):
        make_engine(tiny_llama, num_kv_blocks=None, kv_cache_memory=100, block_size=16)


def test_safetensors_reader_equals_the_safetensors_library(tmp_path):
    """The loader reads safetensors files with plain reads (no mapping that would stay resident):
    every dtype, scalars and empty tensors equal what the safetensors library itself reads, and a
    cut or lying file is refused naming the tensor."""
    import pytest
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine_svc.models.loader import read_safetensors_file

    g = torch.Generator().manual_seed(5)
    tensors = {
        "w.bf16": torch.randn(7, 33, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(3, 5, generator=g).half(),
        "w.f32": torch.randn(64, generator=g),
        "w.f64": torch.randn(2, 2, generator=g).double(),
        "i.i64": torch.arange(-5, 6),
        "i.i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "u.u8": torch.randint(0, 255, (4, 4), generator=g, dtype=torch.uint8),
        "b.bool": torch.rand(6, generator=g) > 0.5,
        "s.scalar": torch.tensor(3.25),
        "e.empty": torch.zeros(0, 8),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    got = dict(read_safetensors_file(path))
    with safe_open(str(path), framework="pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    assert got.keys() == want.keys() == tensors.keys()
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), k

    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="spans bytes|cut short"):
        list(read_safetensors_file(tmp_path / "cut.safetensors"))
    (tmp_path / "short.safetensors").write_bytes(data[:5])
    with pytest.raises(ValueError, match="not a safetensors file"):
        list(read_safetensors_file(tmp_path / "short.safetensors"))
    (tmp_path / "header.safetensors").write_bytes((10**9).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError, match="header of 1000000000 bytes"):
        list(read_safetensors_file(tmp_path / "header.safetensors"))
