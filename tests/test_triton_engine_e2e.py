"""The engine with its Triton kernels (run by Triton's interpreter on CPU) generates exactly what HF
transformers generates greedily: chunked prefill over a cached prefix, decodes, prefix-cache hits,
and a long context whose decode steps take the split-KV path."""

from __future__ import annotations

import pytest

# Imported before the interpreter is switched on, as in a full test run (see test_kernels_triton.py).
import triton.language  # noqa: F401
from transformers import AutoModelForCausalLM

from engine_svc import LLM, SamplingParams
from tests.engine_helpers import assert_greedy_matches, hf_greedy, random_prompts
from tests.triton_mode import interpreted_kernels

VOCAB = 1024
MAX_NEW = 8


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()


def _generate_with_triton(model_dir, prompts, **options):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with interpreted_kernels():
        llm = LLM(model=str(model_dir), kernel_backend="triton", device="cpu", dtype="float32", **options)
        assert llm.engine.kernels.name == "triton"
        from triton.runtime.interpreter import InterpretedFunction

        from kernels.triton import paged_attention_varlen

        assert isinstance(paged_attention_varlen._varlen_attention_kernel, InterpretedFunction)
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[-1:], params, use_tqdm=False)  # its prompt now hits the prefix cache
    return [o.outputs[0].token_ids for o in first], again[0].outputs[0].token_ids


def test_triton_engine_matches_hf_greedy_with_chunks_and_prefix_hits(tiny_llama, hf_model):
    prompts = random_prompts([1, 5, 17, 40, 66], VOCAB, seed=3)
    prompts.append(prompts[3][:32] + random_prompts([9], VOCAB, seed=4)[0])  # shares 2 blocks with #3
    outs, again = _generate_with_triton(
        tiny_llama, prompts, block_size=16, max_num_batched_tokens=24, num_kv_blocks=64
    )
    for prompt, got in zip(prompts, outs, strict=True):
        assert_greedy_matches(hf_model, prompt, got, hf_greedy(hf_model, prompt, MAX_NEW))
    assert again == outs[-1]


def test_triton_engine_long_context_decodes_take_split_kv(tiny_llama, hf_model, monkeypatch):
    prompt = random_prompts([600], VOCAB, seed=5)[0]
    splits = []
    with interpreted_kernels():
        # The module the engine is about to import, so the spy sees the engine's own calls.
        from kernels.triton import paged_attention as dispatch

        real = dispatch.choose_num_splits
        monkeypatch.setattr(dispatch, "choose_num_splits", lambda *a: splits.append(real(*a)) or splits[-1])
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        llm = LLM(
            model=str(tiny_llama),
            kernel_backend="triton",
            device="cpu",
            dtype="float32",
            block_size=32,
            max_num_batched_tokens=256,
            num_kv_blocks=32,
        )
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert max(splits) > 1, "decode steps over a 600-token context should split the KV"
    assert_greedy_matches(hf_model, prompt, got, hf_greedy(hf_model, prompt, MAX_NEW))
