"""The real Gemma 3 270M (base) file, models/gemma3-270m/gemma-3-270m-q4_k_m.gguf (Q4_K_M: Q5_0,
Q8_0, Q4_K and Q6_K blocks), served as it is, against transformers' own GGUF loader on the same file
(dequantized, fp32), on three prompts of 16 greedy tokens:

- our exact path: the file's blocks on the quantized GEMMs with fp32 activations
  (``quantized_activations="none"``, bit-equal to the fp32 model on the dequantized weights,
  docs/quantization.md; ``quantization="none"``, every tensor dequantized at load as transformers
  does, gives the same tokens but loads in minutes through the gguf package's numpy dequantizers):
  the same tokens (chunked prefill of 8 tokens, the three prompts batched);
- the default path (the file's own blocks on the quantized GEMMs, int8 activations, as llama.cpp
  multiplies them): the same first tokens; past those it may leave the fp32 reference, as llama.cpp
  does (measured: 16, 16 and 5 equal tokens), since its activations are rounded to int8 per row.

Skipped, with the reason, where the file is absent (the gemma3-270m wheel parts, docs/models.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_svc import LLM, SamplingParams
from tests.engine_helpers import assert_greedy_matches, hf_greedy

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"

pytestmark = pytest.mark.skipif(not GGUF.exists(), reason=f"{GGUF} is absent (the gemma3-270m wheel parts)")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def exact():
    return LLM(model=str(GGUF), quantized_activations="none", max_num_batched_tokens=8, num_kv_blocks=64)


@pytest.fixture(scope="module")
def reference(exact):
    """(transformers' model, the prompts' ids, its greedy tokens for each)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32)
    hf.eval()
    prompts = [exact.get_tokenizer().encode(p) for p in PROMPTS]
    return hf, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def test_spec_is_the_files(exact):
    spec = exact.engine.spec
    assert (spec.architecture, spec.num_layers, spec.hidden_size, spec.head_dim) == (
        "Gemma3ForCausalLM",
        18,
        640,
        256,
    )
    windows = [a.window for a in spec.layer_attention]
    assert windows == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert exact.engine.max_model_len == 32768 and spec.tie_word_embeddings


def test_exact_path_equals_transformers_gguf_loader(exact, reference):
    hf, prompts, refs = reference
    assert all(p[0] == 2 for p in prompts)  # <bos>, as the file asks
    outs = exact.generate(prompts, GREEDY, use_tqdm=False)
    assert exact.engine.model.native_loop_reason is None
    for prompt, out, ref in zip(prompts, outs, refs, strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0].token_ids, ref)


def test_default_path_serves_the_files_blocks(reference):
    hf, prompts, refs = reference
    llm = LLM(model=str(GGUF), num_kv_blocks=64)
    kinds = {type(layer.o_proj).__name__ for layer in llm.engine.model.layers}
    assert kinds <= {"QuantLinear", "Int8ActLinear"}, kinds
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids[:4] == ref[:4]
    assert "France" in outs[0].outputs[0].text
