"""The real-model tier on a catalogue model bigger than the default: Qwen2.5-Coder-0.5B-Instruct
(Q4_K_M, qwen2 with qkv bias, 24 layers), as `make model MODEL=qwen2.5-coder-0.5b` places it.

- the GGUF file loads as the architecture its metadata says;
- greedy tokens equal transformers' own GGUF loader (both dequantize to float32) on chat prompts
  rendered with the model's template;
- a coding question gets code;
- Gemma 3 270M, pulled by the catalogue, loads as gemma3 (its tokens: tests/test_real_gemma3.py).

Skipped, naming the command, where a model is not in models/ (CI does not download them).
"""

from __future__ import annotations

import pytest
import torch

from engine_svc import LLM, SamplingParams
from tests.conftest import catalogue_model_path
from tests.engine_helpers import assert_greedy_matches, hf_greedy

CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What does the SQL keyword JOIN do? One sentence."}],
]


@pytest.fixture(scope="module")
def gguf():
    return catalogue_model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def llm(gguf):
    return LLM(model=str(gguf), dtype="float32", max_num_batched_tokens=64)


def test_loads_as_its_metadata_says(llm):
    spec = llm.engine.spec
    assert (spec.architecture, spec.num_layers, spec.hidden_size, spec.vocab_size) == (
        "Qwen2ForCausalLM",
        24,
        896,
        151936,
    )
    # the file stores output.weight apart from token_embd.weight (291 tensors: 24 x 12 + 3)
    assert (spec.num_heads, spec.num_kv_heads, spec.tie_word_embeddings) == (14, 2, False)
    assert 151645 in spec.eos_token_ids  # <|im_end|>
    assert llm.get_tokenizer().has_chat_template


def test_greedy_tokens_equal_transformers_gguf_loader(llm, gguf):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(c) for c in CHATS]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_matches(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 16))


def test_a_coding_question_gets_code(llm):
    out = llm.chat([CHATS[0]], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert "def " in out.outputs[0].text, out.outputs[0].text


def test_gemma3_is_pulled_and_served():
    """Served: its tokens against transformers' GGUF loader are tests/test_real_gemma3.py's."""
    from engine_svc.models.catalogue import entry
    from engine_svc.models.gguf_checkpoint import GGUFCheckpoint

    path = catalogue_model_path("gemma3-270m")
    assert entry("gemma3-270m").served
    assert GGUFCheckpoint(path).config()["architectures"] == ["Gemma3ForCausalLM"]
