"""Tensor parallelism on CPU with gloo: TP=2 gives the same greedy tokens as TP=1 (and as HF),
with prefix caching and chunked prefill on; the worker processes are gone afterwards."""

from __future__ import annotations

import pytest
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

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _run(model_dir, tp: int):
    engine = make_engine(
        model_dir,
        tensor_parallel_size=tp,
        block_size=8,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    try:
        prompts = random_prompts([3, 17, 40], 1024, seed=31)
        prompts.append(prompts[2][:32] + [9, 9, 9])  # shares 4 cached blocks with the third
        reqs = {str(i): (p, PARAMS) for i, p in enumerate(prompts)}
        first = run_to_completion(engine, dict(list(reqs.items())[:3]))
        second = run_to_completion(engine, dict(list(reqs.items())[3:]))
        assert engine.stats().prefix_hit_tokens > 0
        workers = list(engine.tp_group.workers) if engine.tp_group else []
        return prompts, {**first, **second}, workers
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_equals_tp1(tiny_models, arch):
    prompts, tp1, _ = _run(tiny_models[arch], 1)
    _, tp2, workers = _run(tiny_models[arch], 2)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype="float32").eval()
    for i, p in enumerate(prompts):
        ref = hf_greedy(hf, p, 8)
        assert_greedy_matches(hf, p, tp1[(str(i), 0)], ref)
        assert_greedy_matches(hf, p, tp2[(str(i), 0)], ref)
    assert workers and all(w.poll() is not None for w in workers)  # no worker left running


def test_tp2_with_replicated_kv_heads(tmp_path):
    d = build_random_model(
        tmp_path / "m",
        "llama",
        seed=8,
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    prompts, tp1, _ = _run(d, 1)
    _, tp2, _ = _run(d, 2)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype="float32").eval()
    for i, p in enumerate(prompts):
        assert_greedy_matches(hf, p, tp2[(str(i), 0)], tp1[(str(i), 0)])


def test_tp_size_must_divide_the_heads(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads"):
        make_engine(tiny_llama, tensor_parallel_size=3)


def test_tp2_lora_equals_tp1(tiny_models, tmp_path):
    """Adapters sharded like their base layers: a batch mixing the base and three adapters (on two
    slots, so workers swap too) gives the same greedy tokens at TP=2 as at TP=1."""
    from tests.lora_helpers import ALL_TARGETS, make_adapter

    model_dir = tiny_models["qwen2"]
    adapters = {
        "a": make_adapter(model_dir, tmp_path / "a", 4, ["q_proj", "k_proj", "o_proj"], seed=1),
        "b": make_adapter(model_dir, tmp_path / "b", 8, ALL_TARGETS, rslora=True, seed=2),
        "c": make_adapter(
            model_dir, tmp_path / "c", 16, ["v_proj", "gate_proj", "up_proj", "down_proj"], seed=3
        ),
    }
    prompts = random_prompts([3, 17, 40, 9, 25, 12], 1024, seed=32)
    prompts.append(prompts[2])  # the base's prompt under an adapter: the adapter must change it
    loras = [None, "a", None, "c", "a", "c", "b"]
    outs = {}
    for tp in (1, 2):
        engine = make_engine(
            model_dir,
            tensor_parallel_size=tp,
            block_size=8,
            max_num_batched_tokens=24,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
        )
        try:
            for name, path in adapters.items():
                engine.add_lora(name, str(path))
            for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
                engine.add_request(str(i), p, PARAMS, lora=lora)
            got: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for d in engine.step():
                    got.setdefault(d.request_id, []).extend(d.new_token_ids)
            outs[tp] = got
            assert engine.lora.slots.num_swaps > 2
        finally:
            engine.shutdown()
    assert outs[1] == outs[2]
    assert outs[1]["6"] != outs[1]["2"]
