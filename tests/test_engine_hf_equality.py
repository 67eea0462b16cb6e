"""The floor under everything: greedy tokens equal HF transformers' on the same weights, whatever the
block size, chunking, prefix caching, preemption or arrival pattern."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from engine_svc import SamplingParams
from tests.engine_helpers import (
    assert_greedy_matches,
    hf_greedy,
    make_engine,
    random_prompts,
    run_to_completion,
)

VOCAB = 1024
MAX_NEW = 12
# From 1 token to more than 3 blocks of 32; lengths chosen to end mid-block and on block edges.
LENGTHS = [1, 3, 8, 15, 16, 17, 50, 101]
SHARED_PREFIX = random_prompts([40], VOCAB, seed=99)[0]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def arch_case(request, tiny_models):
    model_dir = tiny_models[request.param]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts = random_prompts(LENGTHS, VOCAB, seed=7)
    prompts += [SHARED_PREFIX + suffix for suffix in random_prompts([1, 9, 24], VOCAB, seed=8)]
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return model_dir, hf, prompts, refs


def _check(engine, hf, prompts, refs, add_later_from: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    reqs = {str(i): (p, params) for i, p in enumerate(prompts)}
    later = None
    if add_later_from is not None:
        later = {k: v for k, v in reqs.items() if int(k) >= add_later_from}
        reqs = {k: v for k, v in reqs.items() if int(k) < add_later_from}
    outputs = run_to_completion(engine, reqs, add_later=later)
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert_greedy_matches(hf, p, outputs[(str(i), 0)], ref)
    return engine.stats()


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 13), (32, 40)])
def test_greedy_equals_hf(arch_case, block_size, budget):
    model_dir, hf, prompts, refs = arch_case
    engine = make_engine(model_dir, block_size=block_size, max_num_batched_tokens=budget, num_kv_blocks=256)
    _check(engine, hf, prompts, refs)


def test_greedy_equals_hf_with_prefix_hits(arch_case):
    model_dir, hf, prompts, refs = arch_case
    engine = make_engine(model_dir, block_size=8, max_num_batched_tokens=64)
    _check(engine, hf, prompts, refs)  # fills the cache
    stats = _check(engine, hf, prompts, refs)  # the same prompts again: served from cached blocks
    assert stats.prefix_hit_tokens > 0


def test_greedy_equals_hf_under_preemption(arch_case):
    model_dir, hf, prompts, refs = arch_case
    # 15 blocks of 8 tokens: the longest request alone needs 15, so the batch must preempt.
    engine = make_engine(model_dir, block_size=8, num_kv_blocks=15, max_num_batched_tokens=32)
    stats = _check(engine, hf, prompts, refs)
    assert stats.num_preemptions > 0


def test_greedy_equals_hf_when_requests_arrive_mid_decode(arch_case):
    model_dir, hf, prompts, refs = arch_case
    engine = make_engine(model_dir, block_size=16, max_num_batched_tokens=24)
    _check(engine, hf, prompts, refs, add_later_from=4)


def test_caching_and_chunking_do_not_change_outputs(tiny_llama):
    prompts = random_prompts([5, 33, 70, 70], VOCAB, seed=3)
    prompts[3][:48] = prompts[2][:48]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for caching in (True, False):
        for chunking, budget in ((True, 16), (False, 512)):
            engine = make_engine(
                tiny_llama,
                enable_prefix_caching=caching,
                enable_chunked_prefill=chunking,
                max_num_batched_tokens=budget,
            )
            results.append(run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)}))
    assert all(r == results[0] for r in results)
