"""Multi-LoRA serving, engine level: greedy tokens equal PEFT's (and the merged model's) for several
ranks and target sets on Llama and Qwen2; a batch mixing the base and three adapters gives every
request its solo result with chunked prefill, preemption, prefix caching and slot swapping all
happening; KV is never shared across adapters; bad adapters are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc import LLM, LoRARequest, SamplingParams
from engine_svc.lora.adapter import AdapterError
from engine_svc.lora.manager import AdapterNotFound
from tests.engine_helpers import (
    assert_greedy_matches,
    assert_pool_whole,
    hf_greedy,
    make_engine,
    random_prompts,
)
from tests.lora_helpers import ALL_TARGETS, make_adapter, peft_model

VOCAB = 1024
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "qv4": (4, 8.0, ["q_proj", "v_proj"], False),
    "all8rs": (8, 16.0, ALL_TARGETS, True),
    "mlp16": (16, 32.0, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "k2": (2, 4.0, ["k_proj", "up_proj"], False),
}


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """{(arch, name): adapter dir} for Llama and Qwen2."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for arch in ("llama", "qwen2"):
        for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
            out[(arch, name)] = make_adapter(
                tiny_models[arch], root / f"{arch}-{name}", r, targets, alpha, rslora, seed=10 + i
            )
    return out


def _engine(model_dir, **overrides):
    options = dict(enable_lora=True, max_loras=4, max_lora_rank=16)
    options.update(overrides)
    return make_engine(model_dir, **options)


def _run(engine, requests: dict[str, tuple[list[int], str | None]], params=GREEDY) -> dict[str, list[int]]:
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, params, lora=lora)
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        running = engine.stats().running_lora_adapters
        assert len(running) <= engine.config.max_loras, f"{running} run on {engine.config.max_loras} slots"
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        engine.check_invariants()
        steps += 1
        assert steps < 5000
    assert_pool_whole(engine)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_greedy_equals_peft_and_merged(tiny_models, adapters, arch, name):
    model_dir, adapter_dir = tiny_models[arch], adapters[(arch, name)]
    prompts = random_prompts([1, 7, 23, 40], VOCAB, seed=5)
    engine = _engine(model_dir, max_num_batched_tokens=16, block_size=8)  # chunked prefill
    engine.add_lora(name, str(adapter_dir))
    got = _run(engine, {str(i): (p, name) for i, p in enumerate(prompts)})
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for merged in (False, True):
        hf = peft_model(model_dir, adapter_dir, merged=merged)
        for i, p in enumerate(prompts):
            ref = hf_greedy(hf, p, MAX_NEW)
            assert_greedy_matches(hf, p, got[str(i)], ref)
            if not merged:
                # The adapter changes the output (else this test would prove nothing).
                assert ref != hf_greedy(base, p, MAX_NEW) or i == 0


def test_offline_api_like_vllm(tiny_models, adapters):
    model_dir = tiny_models["llama"]
    a, b = adapters[("llama", "qv4")], adapters[("llama", "all8rs")]
    prompts = random_prompts([6, 12, 18], VOCAB, seed=8)
    with LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64) as llm:
        one = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(a)))
        mixed = llm.generate(
            prompts,
            GREEDY,
            use_tqdm=False,
            lora_request=[LoRARequest("b", 2, str(b)), None, LoRARequest("a", 1, str(a))],
        )
        base = llm.generate(prompts, GREEDY, use_tqdm=False)
    hf_a, hf_b = peft_model(model_dir, a), peft_model(model_dir, b)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        assert one[i].outputs[0].token_ids == hf_greedy(hf_a, p, MAX_NEW)
        assert base[i].outputs[0].token_ids == hf_greedy(hf, p, MAX_NEW)
    assert mixed[0].outputs[0].token_ids == hf_greedy(hf_b, prompts[0], MAX_NEW)
    assert mixed[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == one[2].outputs[0].token_ids


def test_mixed_batch_equals_solo_with_chunking_preemption_caching_and_swaps(tiny_models, adapters):
    """The base and three adapters in one batch, on 2 slots and a pool too small for all of them."""
    model_dir = tiny_models["qwen2"]
    names = ["qv4", "all8rs", "mlp16"]
    prefix = random_prompts([24], VOCAB, seed=1)[0]
    prompts = [prefix + s for s in random_prompts([3, 17, 30, 9, 41, 5, 22, 12], VOCAB, seed=2)]
    loras = [None, "qv4", "all8rs", "mlp16", "mlp16", None, "qv4", "all8rs"]
    requests = {str(i): (p, lora) for i, (p, lora) in enumerate(zip(prompts, loras, strict=True))}
    engine = _engine(model_dir, max_loras=2, block_size=8, num_kv_blocks=24, max_num_batched_tokens=20)
    for name in names:
        engine.add_lora(name, str(adapters[("qwen2", name)]))
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, GREEDY, lora=lora)
    first: dict[str, list[int]] = {}
    for delta in engine.step():
        first.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    st = engine.stats()  # the figures behind vllm:lora_requests_info
    assert st.max_lora == 2 and set(st.running_lora_adapters) | set(st.waiting_lora_adapters) == set(names)
    assert len(st.running_lora_adapters) <= 2 and st.waiting_lora_adapters
    rest = _run(engine, {})
    mixed = {rid: first.get(rid, []) + rest.get(rid, []) for rid in requests}
    again = _run(engine, {f"again{rid}": r for rid, r in requests.items()})  # served from the cache
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool never ran dry: no preemption was tested"
    assert stats.prefix_hit_tokens > 0, "no prefix hit was tested"
    assert engine.lora.slots.num_swaps > len(names), "no adapter was swapped out and back in"
    for rid, (prompt, lora) in requests.items():
        solo_engine = _engine(model_dir, block_size=8, max_loras=1)
        if lora:
            solo_engine.add_lora(lora, str(adapters[("qwen2", lora)]))
        solo = _run(solo_engine, {rid: (prompt, lora)})
        assert mixed[rid] == solo[rid], f"request {rid} ({lora or 'base'}) differs from its solo run"
        assert again[f"again{rid}"] == solo[rid]


def _cached_tokens(engine, rid, prompt, lora) -> int:
    engine.add_request(rid, prompt, GREEDY, lora=lora)
    cached = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            cached = delta.num_cached_tokens
    return cached


def test_prefix_cache_is_never_shared_across_adapters(tiny_models, adapters):
    engine = _engine(tiny_models["llama"], block_size=8)
    for name in ("qv4", "all8rs"):
        engine.add_lora(name, str(adapters[("llama", name)]))
    prompt = random_prompts([40], VOCAB, seed=4)[0]
    assert _cached_tokens(engine, "a1", prompt, "qv4") == 0
    assert _cached_tokens(engine, "b1", prompt, "all8rs") == 0, "KV of adapter qv4 was served to all8rs"
    assert _cached_tokens(engine, "base", prompt, None) == 0, "adapter KV was served to the base model"
    assert _cached_tokens(engine, "a2", prompt, "qv4") > 0, "the same adapter did not share its KV"
    assert _cached_tokens(engine, "b2", prompt, "all8rs") > 0
    # A reload is a new version: KV of the old version is not served to it.
    engine.add_lora("qv4", str(adapters[("llama", "k2")]))
    assert _cached_tokens(engine, "a3", prompt, "qv4") == 0


def test_reload_serves_the_new_weights_and_unload_forgets(tiny_models, adapters):
    model_dir = tiny_models["llama"]
    engine = _engine(model_dir, max_loras=1)
    prompt = random_prompts([12], VOCAB, seed=6)[0]
    engine.add_lora("x", str(adapters[("llama", "qv4")]))
    first = _run(engine, {"1": (prompt, "x")})["1"]
    engine.add_lora("x", str(adapters[("llama", "mlp16")]))
    second = _run(engine, {"2": (prompt, "x")})["2"]
    assert first == hf_greedy(peft_model(model_dir, adapters[("llama", "qv4")]), prompt, MAX_NEW)
    assert second == hf_greedy(peft_model(model_dir, adapters[("llama", "mlp16")]), prompt, MAX_NEW)
    engine.remove_lora("x")
    assert engine.list_loras() == []
    with pytest.raises(AdapterNotFound, match="'x'"):
        engine.add_request("3", prompt, GREEDY, lora="x")
    with pytest.raises(AdapterNotFound, match="'x'"):
        engine.remove_lora("x")


def test_unload_refused_while_in_use(tiny_models, adapters):
    engine = _engine(tiny_models["llama"])
    engine.add_lora("a", str(adapters[("llama", "qv4")]))
    engine.add_request("r", [5, 6, 7], GREEDY, lora="a")
    engine.step()
    with pytest.raises(ValueError, match="in use by 1 live request"):
        engine.remove_lora("a")
    _run(engine, {})
    engine.remove_lora("a")


def test_base_steps_do_no_lora_work(tiny_models, adapters, monkeypatch):
    engine = _engine(tiny_models["llama"])
    engine.add_lora("a", str(adapters[("llama", "qv4")]))
    calls = []
    monkeypatch.setattr(engine.lora, "kernel", lambda *a: calls.append(1))
    _run(engine, {"0": ([5, 6, 7, 8], None), "1": ([9, 10], None)})
    assert calls == []
    _run(engine, {"2": ([5, 6, 7, 8], "a")})
    assert calls


def test_unknown_adapter_and_lora_off(tiny_models):
    engine = _engine(tiny_models["llama"])
    with pytest.raises(AdapterNotFound, match="no LoRA adapter named 'nope'"):
        engine.add_request("r", [5], GREEDY, lora="nope")
    assert not engine.requests
    plain = make_engine(tiny_models["llama"])
    with pytest.raises(AdapterNotFound, match="not enabled"):
        plain.add_request("r", [5], GREEDY, lora="nope")
    with pytest.raises(ValueError, match="not enabled"):
        plain.add_lora("a", "/nowhere")


# --- refusals -----------------------------------------------------------------------------------
def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return dst


def test_bad_adapters_are_refused_by_name(tiny_models, adapters, tmp_path):
    llama = tiny_models["llama"]
    engine = _engine(llama, max_lora_rank=8)
    good = adapters[("llama", "qv4")]
    cases = {
        "rank 16, above max_lora_rank 8": adapters[("llama", "mlp16")],
        "does not exist": tmp_path / "missing",
        "no adapter_config.json": tmp_path / "empty",
        "no adapter_model.safetensors": tmp_path / "noweights",
        "use_dora is not supported": _edit_config(good, tmp_path / "dora", use_dora=True),
        "lora_A shape (4, 64) != (r=2": _edit_config(good, tmp_path / "rank", r=2, lora_alpha=4),
        "target_modules ['lm_head'] not supported": _edit_config(
            good, tmp_path / "head", target_modules=["q_proj", "lm_head"]
        ),
    }
    (tmp_path / "empty").mkdir()
    shutil.copytree(good, tmp_path / "noweights")
    (tmp_path / "noweights" / "adapter_model.safetensors").unlink()
    for why, path in cases.items():
        with pytest.raises(AdapterError, match=__import__("re").escape(why)):
            engine.add_lora("bad", str(path))
        assert engine.list_loras() == [], f"a refused adapter ({why}) was kept"


def test_adapter_for_another_model_shape_is_refused(tiny_models, tmp_path):
    from engine_svc.models.build import build_random_model

    other = build_random_model(
        tmp_path / "wide", "llama", hidden_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    adapter = make_adapter(other, tmp_path / "wide-lora", 4, ["q_proj"])
    engine = _engine(tiny_models["llama"])
    with pytest.raises(
        AdapterError, match=r"layer 0 q_proj: lora_A shape \(4, 96\) != \(r=4, in_features=64\)"
    ):
        engine.add_lora("wide", str(adapter))
