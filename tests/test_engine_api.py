"""The step-level engine API: aborts in every phase, parallel sampling sharing blocks, stopping
rules, logprobs, priorities, and a clear ValueError for each bad input."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc import SamplingParams
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts, run_to_completion

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.fixture(autouse=True)
def pool_whole_after(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        for rid in list(eng.requests):
            eng.abort_request(rid)
        assert_pool_whole(eng)


def _drain(engine):
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()


@pytest.mark.parametrize("phase", ["waiting", "mid-prefill", "decoding"])
def test_abort_returns_every_block(engine, phase):
    prompt = random_prompts([40], 1024)[0]
    engine.add_request("victim", prompt, SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("other", prompt[:10], SamplingParams(max_tokens=5, **GREEDY))
    if phase == "mid-prefill":
        engine.step()  # 16-token budget: the 40-token prompt is only partly computed
        seq = engine.requests["victim"].sequences[0]
        assert 0 < seq.num_computed_tokens < 40
    elif phase == "decoding":
        while engine.requests["victim"].sequences[0].num_output_tokens < 2:
            engine.step()
    assert engine.stats().kv_blocks_used > 0 or phase == "waiting"
    assert engine.abort_request("victim")
    engine.check_invariants()
    assert not engine.abort_request("victim")  # a second abort is a no-op
    _drain(engine)


def test_parallel_sampling_shares_prompt_blocks(engine):
    prompt = random_prompts([35], 1024, seed=2)[0]  # 4 full blocks of 8 and a partial one
    engine.add_request(
        "n4", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    )
    outputs = {}
    while not engine.requests["n4"].forked:
        for d in engine.step():
            outputs.setdefault(d.index, []).extend(d.new_token_ids)
    seqs = engine.requests["n4"].sequences
    assert len(seqs) == 4
    # The 4 full prompt blocks are held once, by reference from each sequence.
    shared = set(engine.kv.block_table(seqs[0])[:4])
    assert all(set(engine.kv.block_table(s)[:4]) == shared for s in seqs)
    assert all(engine.kv.pool.blocks[b].ref_count == 4 for b in shared)
    used_after_fork = engine.stats().kv_blocks_used
    assert used_after_fork < 4 * 5  # 4 unshared copies would need 20 blocks
    engine.check_invariants()
    while engine.has_unfinished_requests():
        for d in engine.step():
            outputs.setdefault(d.index, []).extend(d.new_token_ids)
        engine.check_invariants()
    assert sorted(outputs) == [0, 1, 2, 3] and all(len(v) == 6 for v in outputs.values())
    assert len({tuple(v) for v in outputs.values()}) > 1  # they really sample independently


def test_parallel_greedy_sequences_equal_single(tiny_llama):
    prompt = random_prompts([21], 1024, seed=4)[0]
    single = run_to_completion(
        make_engine(tiny_llama, block_size=8), {"a": (prompt, SamplingParams(max_tokens=9, **GREEDY))}
    )
    par = run_to_completion(
        make_engine(tiny_llama, block_size=8), {"a": (prompt, SamplingParams(n=3, max_tokens=9, **GREEDY))}
    )
    assert par[("a", 0)] == par[("a", 1)] == par[("a", 2)] == single[("a", 0)]


def test_stopping_rules(engine):
    prompt = random_prompts([6], 1024, seed=11)[0]
    free = run_to_completion(engine, {"f": (prompt, SamplingParams(max_tokens=10, **GREEDY))})[("f", 0)]
    stop_tok = free[4]
    first = free.index(stop_tok)
    engine.add_request("s", prompt, SamplingParams(max_tokens=10, stop_token_ids=[stop_tok], **GREEDY))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [t for d in deltas for t in d.new_token_ids] == free[: first + 1]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_token_id == stop_tok
    # min_tokens bans the stop token until enough tokens exist
    out = run_to_completion(
        engine,
        {
            "m": (
                prompt,
                SamplingParams(max_tokens=10, min_tokens=first + 2, stop_token_ids=[stop_tok], **GREEDY),
            )
        },
    )
    assert stop_tok not in out[("m", 0)][: first + 2]


def test_eos_from_generation_config_stops(tiny_llama):
    engine = make_engine(tiny_llama)
    assert set(engine.model_info.eos_token_ids) == {2, 0}
    prompt = random_prompts([5], 1024, seed=1)[0]
    free = run_to_completion(engine, {"a": (prompt, SamplingParams(max_tokens=8, **GREEDY))})[("a", 0)]
    # Make one generated token an EOS by asking the engine to treat it as one.
    engine.spec = engine.spec.__class__(**{**engine.spec.__dict__, "eos_token_ids": (free[2],)})
    engine.add_request("b", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [t for d in deltas for t in d.new_token_ids] == free[: free.index(free[2]) + 1]
    assert deltas[-1].finish_reason == "stop"


def test_logprobs_and_prompt_logprobs_match_hf(tiny_llama, engine):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()
    prompt = random_prompts([19], 1024, seed=12)[0]
    engine.add_request("lp", prompt, SamplingParams(max_tokens=3, logprobs=3, prompt_logprobs=2, **GREEDY))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    plp = deltas[0].prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [d.new_token_ids[0] for d in deltas]])).logits[0].log_softmax(-1)
    for i in range(1, len(prompt)):
        assert plp[i].token_id == prompt[i]
        assert math.isclose(plp[i].logprob, float(ref[i - 1, prompt[i]]), abs_tol=1e-4)
        assert len(plp[i].top_ids) == 2
    for j, d in enumerate(deltas):
        lp = d.logprobs[0]
        pos = len(prompt) - 1 + j
        assert lp.rank == 1 and lp.top_ids[0] == lp.token_id
        assert math.isclose(lp.logprob, float(ref[pos, lp.token_id]), abs_tol=1e-4)
        assert len(lp.top_ids) == 3


def test_priority_policy_serves_urgent_first(tiny_llama):
    engine = make_engine(tiny_llama, scheduling_policy="priority", max_num_seqs=1)
    prompts = random_prompts([4, 4, 4], 1024)
    engine.add_request("late", prompts[0], SamplingParams(max_tokens=2, **GREEDY), priority=5)
    engine.add_request("urgent", prompts[1], SamplingParams(max_tokens=2, **GREEDY), priority=-1)
    engine.add_request("normal", prompts[2], SamplingParams(max_tokens=2, **GREEDY), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [d.request_id for d in engine.step() if d.finished]
    assert order == ["urgent", "normal", "late"]
    assert_pool_whole(engine)


BAD_INPUTS = [
    (dict(prompt=[5, 2000]), "outside the vocabulary"),
    (dict(prompt=[]), "must not be empty"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(n=0), "n must be >= 1"),
    (dict(prompt=[5] * 1100), "max_model_len is 1024"),
    (dict(max_tokens=2000), "exceeds max_model_len (1024)"),
    (dict(top_k=-2), "top_k must be >= -1"),
    (dict(logprobs=50), "logprobs must be <= 20"),
    (dict(stop_token_ids=[99999]), "stop_token_ids[0] is 99999, outside the vocabulary [0, 1024)"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be <= max_tokens (10)"),
]


@pytest.mark.parametrize("change,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_raises_and_changes_nothing(engine, change, message):
    change = dict(change)
    prompt = change.pop("prompt", [5, 6, 7])
    before = engine.stats()
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", prompt, SamplingParams(**{"max_tokens": 4, **change}))
    assert message in str(err.value)
    assert engine.stats() == before and "bad" not in engine.requests


def test_request_larger_than_the_cache_is_refused(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8, num_kv_blocks=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks; the whole cache has 4"):
        engine.add_request("big", list(range(3, 40)), SamplingParams(max_tokens=1))


def test_duplicate_live_request_id_is_refused(engine):
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=3, **GREEDY))
    _drain(engine)


def test_urgent_request_preempts_a_lower_priority_one(tiny_llama):
    engine = make_engine(tiny_llama, scheduling_policy="priority", block_size=8, num_kv_blocks=10)
    long_prompt, short_prompt = random_prompts([60, 20], 1024, seed=9)
    engine.add_request("background", long_prompt, SamplingParams(max_tokens=10, **GREEDY), priority=10)
    engine.step()
    engine.step()  # the background request now holds most of the pool
    engine.add_request("urgent", short_prompt, SamplingParams(max_tokens=4, **GREEDY), priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [d.request_id for d in engine.step() if d.finished]
        engine.check_invariants()
    assert finished == ["urgent", "background"]
    assert engine.stats().num_preemptions >= 1
    assert_pool_whole(engine)


def test_the_engine_leaves_the_callers_config_and_params_as_they_were(tiny_llama):
    """Without chunked prefill the engine raises its own step budget to the context, and it gives a
    request the model's EOS ids: in its own copies. A caller reusing its config or params (another
    engine, another request) gets what it wrote."""
    import copy

    from engine_svc import EngineConfig
    from engine_svc.engine import LLMEngine

    config = EngineConfig(
        model=str(tiny_llama),
        block_size=16,
        num_kv_blocks=256,
        max_num_batched_tokens=64,
        enable_chunked_prefill=False,
    )
    given = copy.deepcopy(config)
    engine = LLMEngine(config)
    assert config == given
    assert engine.config.max_num_batched_tokens == engine.max_model_len > 64
    params = SamplingParams(temperature=0.0, max_tokens=3, stop=["x"])
    written = copy.deepcopy(params)
    (prompt,) = random_prompts([5], 1024, seed=1)
    out = run_to_completion(engine, {"a": (prompt, params)})
    assert params == written and params.eos_token_ids == ()
    assert engine.requests == {} and len(out[("a", 0)]) >= 1
