"""benchmarks/requantize_gguf.py: the Q8_0 file the issue's batch-1 comparison runs on is the same
model as its source. Read back with the gguf package and with transformers' GGUF loader (both
independent of the writer): same metadata, float tensors untouched, each quantized weight within
half a Q8_0 step of the source's values, and the engine's greedy tokens equal transformers' on it."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM

from benchmarks.requantize_gguf import requantize
from engine_svc import SamplingParams
from tests.engine_helpers import (
    assert_greedy_matches,
    hf_greedy,
    make_engine,
    random_model,
    random_prompts,
    run_to_completion,
)
from tests.gguf_files import write_gguf


def _source(tmp_path, tokenizer_dir):
    d = random_model(
        tmp_path / "hf",
        tokenizer_dir,
        seed=5,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_key_value_heads=2,
        num_attention_heads=4,
    )
    (tmp_path / "src").mkdir()
    return write_gguf(d, tmp_path / "src" / "model.Q4_1.gguf", "Q4_1")


def test_q8_0_copy_keeps_the_metadata_and_the_weights(tmp_path, trained_tokenizer_dir):
    src = _source(tmp_path, trained_tokenizer_dir)
    out = requantize(src, "Q8_0", tmp_path / "out" / "model.Q8_0.gguf")
    a, b = GGUFReader(str(src)), GGUFReader(str(out))
    user_keys = [k for k in a.fields if not k.startswith("GGUF.")]
    assert user_keys == [k for k in b.fields if not k.startswith("GGUF.")]
    for key in user_keys:
        assert a.fields[key].contents() == b.fields[key].contents(), key
    by_name = {t.name: t for t in b.tensors}
    assert [t.name for t in a.tensors] == list(by_name)
    quantized = 0
    for t in a.tensors:
        new = by_name[t.name]
        if t.tensor_type == GGMLQuantizationType.F32:
            assert new.tensor_type == GGMLQuantizationType.F32
            assert np.array_equal(np.array(t.data), np.array(new.data))
            continue
        quantized += 1
        assert new.tensor_type == GGMLQuantizationType.Q8_0, t.name
        before = dequantize(np.array(t.data), t.tensor_type).reshape(-1, 32)
        after = dequantize(np.array(new.data), new.tensor_type).reshape(-1, 32)
        step = np.abs(before).max(axis=1, keepdims=True) / 127  # Q8_0's scale per block of 32
        worst = (np.abs(after - before) / np.where(step > 0, step, 1)).max()
        # half a step, plus the fp16 rounding of the scale times up to 127
        assert worst <= 0.5 + 127 * 2**-11 + 1e-6, (t.name, worst)
    assert quantized >= 2 * 7  # every linear of both layers (and the embedding) was rewritten


def test_engine_tokens_on_the_copy_equal_transformers(tmp_path, trained_tokenizer_dir):
    out = requantize(_source(tmp_path, trained_tokenizer_dir), "Q8_0", tmp_path / "q8" / "model.Q8_0.gguf")
    hf = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    prompts = random_prompts([6, 30], 1024, seed=11)
    engine = make_engine(out, max_num_batched_tokens=24, dtype="float32", quantized_activations="none")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert_greedy_matches(hf, prompt, got[(str(i), 0)], hf_greedy(hf, prompt, 10))
