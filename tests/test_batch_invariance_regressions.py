"""The defects that the batch-invariance issue reproduced, each against its own solo run.

Every test here failed on the engine before the step contract (one ``LogitsLayout``; the scheduler's
``update_from_output``; request liveness in ``Request.ended``; prompt logprobs by position)."""

from __future__ import annotations

from functools import partial

from engine_svc import SamplingParams
from tests.differential import Result, assert_same_as_solo, drive, solo
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_prompt_logprobs_neighbour_does_not_change_greedy_tokens(tiny_llama):
    """The issue's reproduction: ``a`` (prompt logprobs) and ``b`` (greedy) in one step."""
    engine_opts = dict(block_size=16, num_kv_blocks=64, max_num_batched_tokens=512)
    a_prompt, b_prompt = random_prompts([10, 8], 1024, seed=7)
    a_params, b_params = greedy(max_tokens=3, prompt_logprobs=1), greedy(max_tokens=3)
    engine = make_engine(tiny_llama, **engine_opts)
    engine.add_request("a", a_prompt, a_params)
    engine.add_request("b", b_prompt, b_params)
    results: dict[str, Result] = {}
    drive(engine, results)
    assert_pool_whole(engine)
    fresh = partial(make_engine, tiny_llama, **engine_opts)
    assert_same_as_solo("a", results["a"], solo(fresh, a_prompt, a_params), a_params)
    assert_same_as_solo("b", results["b"], solo(fresh, b_prompt, b_params), b_params)


def test_prompt_logprobs_complete_after_preemptions_mid_prefill(tiny_llama):
    """A 60-token prompt with prompt logprobs, chunked and preempted mid-prefill again and again by
    neighbours admitted before it (one plain, one n=2 with prompt logprobs): every entry exactly
    once, equal to the solo run; the neighbours' tokens equal theirs."""
    engine_opts = dict(block_size=8, num_kv_blocks=12, max_num_batched_tokens=24)
    p1, p2, p3 = random_prompts([60, 30, 40], 1024, seed=11)
    fork = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, prompt_logprobs=1, ignore_eos=True)
    requests = {
        "plain": (p2, greedy(max_tokens=30)),
        "fork": (p3, fork),
        "plp": (p1, greedy(max_tokens=4, prompt_logprobs=2)),
    }
    engine = make_engine(tiny_llama, **engine_opts)
    mid_prefill = []
    preempt = engine.scheduler._preempt

    def observe(seq, out):
        if seq.num_computed_tokens < seq.request.num_prompt_tokens:
            mid_prefill.append(seq.request.request_id)
        preempt(seq, out)

    engine.scheduler._preempt = observe
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results: dict[str, Result] = {}
    drive(engine, results)
    assert mid_prefill.count("plp") >= 3, f"the test must preempt mid-prefill: {mid_prefill}"
    assert_pool_whole(engine)
    fresh = partial(make_engine, tiny_llama, **engine_opts)
    for rid, (prompt, params) in requests.items():
        assert_same_as_solo(rid, results[rid], solo(fresh, prompt, params), params)
    assert len(results["plp"].prompt_logprobs) == 60


def test_abort_of_sequence_zero_before_the_fork_keeps_the_others(tiny_llama):
    """``abort_request(rid, index=0)`` while an n=3 prompt is still in prefill: sequences 1 and 2
    still run to their end, each equal to the prompt run alone with its own seed (seed + index)."""
    engine_opts = dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    (prompt,) = random_prompts([45], 1024, seed=5)
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    engine = make_engine(tiny_llama, **engine_opts)
    engine.add_request("r", prompt, params)
    results: dict[str, Result] = {}
    engine.step()  # the first chunk: nothing sampled yet, nothing forked
    assert not engine.requests["r"].forked
    assert engine.abort_request("r", index=0)
    drive(engine, results)
    assert_pool_whole(engine)
    got = results["r"]
    assert sorted(got.outputs) == [1, 2], "aborting sequence 0 must not end the others"
    assert got.request_finished == 1
    fresh = partial(make_engine, tiny_llama, **engine_opts)
    for i in (1, 2):
        one = SamplingParams(n=1, temperature=1.0, seed=42 + i, max_tokens=8, ignore_eos=True)
        ref = solo(fresh, prompt, one).outputs[0]
        assert got.outputs[i].tokens == ref.tokens, f"sequence {i} differs from its solo run"
        assert got.outputs[i].finish_reason == "length"


def test_abort_of_every_index_before_the_fork_ends_the_request(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8, max_num_batched_tokens=16)
    (prompt,) = random_prompts([40], 1024, seed=6)
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, max_tokens=8))
    engine.step()
    for i in (2, 0):
        assert engine.abort_request("r", index=i)
        assert "r" in engine.requests
    assert not engine.abort_request("r", index=0), "an index already aborted is not live"
    assert engine.abort_request("r", index=1)
    assert "r" not in engine.requests
    assert_pool_whole(engine)


def test_copy_on_write_forks_match_their_solo_runs(tiny_llama):
    """Sequence j of a seeded n-request is the prompt run alone with seed + j. The prompts end
    mid-block, so every fork writes into a shared block first: without the copy, the forks would
    overwrite each other's K/V and diverge."""
    engine_opts = dict(block_size=16, num_kv_blocks=128, max_num_batched_tokens=512)
    prompts = random_prompts([21, 37, 50], 1024, seed=9)
    engine = make_engine(tiny_llama, **engine_opts)
    params = [
        SamplingParams(n=4, temperature=1.0, seed=100 * k, max_tokens=12, ignore_eos=True) for k in range(3)
    ]
    for k, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{k}", prompt, p)
    results: dict[str, Result] = {}
    drive(engine, results)
    assert_pool_whole(engine)
    fresh = partial(make_engine, tiny_llama, **engine_opts)
    for k, prompt in enumerate(prompts):
        got = results[f"r{k}"]
        assert sorted(got.outputs) == [0, 1, 2, 3]
        for j in range(4):
            one = SamplingParams(temperature=1.0, seed=100 * k + j, max_tokens=12, ignore_eos=True)
            ref = solo(fresh, prompt, one).outputs[0]
            assert got.outputs[j].tokens == ref.tokens, f"r{k} sequence {j} differs from its solo run"


def test_seeds_use_all_64_bits(tiny_llama):
    """5, 5 - 2**63 and 2**32 + 5 are distinct seeds; 0 and -2**63 too (torch's generator kept 32)."""
    engine = make_engine(tiny_llama)
    (prompt,) = random_prompts([12], 1024, seed=1)
    seeds = [5, 5 - 2**63, 2**32 + 5, 0, -(2**63)]
    for s in seeds:
        engine.add_request(
            f"s{s}", prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True)
        )
    results: dict[str, Result] = {}
    drive(engine, results)
    outs = [tuple(results[f"s{s}"].outputs[0].tokens) for s in seeds]
    assert len(set(outs)) == len(seeds), "distinct 64-bit seeds gave identical streams"
    # and each seed is still reproducible
    engine.add_request(
        "again", prompt, SamplingParams(temperature=1.0, seed=2**32 + 5, max_tokens=24, ignore_eos=True)
    )
    drive(engine, results)
    assert tuple(results["again"].outputs[0].tokens) == outs[2]


def test_a_block_is_shared_only_under_the_same_prefix(tiny_llama):
    """Two prompts whose second blocks are equal but whose first blocks differ: the second block's
    K/V depends on the first, so it must not be shared (the hash chains each block to its parent)."""
    engine_opts = dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=64)
    x, y, z, tail = random_prompts([8, 8, 8, 5], 1024, seed=21)
    a, b = x + y + tail, z + y + tail
    params = greedy(max_tokens=10, logprobs=1)
    engine = make_engine(tiny_llama, **engine_opts)
    results: dict[str, Result] = {}
    engine.add_request("a", a, params)
    drive(engine, results)
    engine.add_request("b", b, params)
    engine.add_request("a2", a, params)  # the same prefix again: this one is a real hit
    drive(engine, results)
    # only a2 may hit: a's two full blocks, then 4 of its tail's 5 tokens in a's third block (a
    # partial-block hit; never the prompt's last token)
    assert engine.stats().prefix_hit_tokens == 16 + 4, "only a2 may hit, on a's blocks"
    fresh = partial(make_engine, tiny_llama, **engine_opts)
    assert_same_as_solo("b", results["b"], solo(fresh, b, params), params)
    assert_same_as_solo("a2", results["a2"], solo(fresh, a, params), params)


def test_a_hash_collision_never_serves_another_prompts_blocks(tiny_llama):
    """Block hashes forced to collide (every block hashed by its position alone): the stored token
    ids, checked on every hit, are all that keeps one prompt's K/V from another."""
    engine_opts = dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=64)
    engine = make_engine(tiny_llama, **engine_opts)
    engine.kv.block_hashes = lambda seq, num_blocks: list(range(num_blocks))
    a, b = random_prompts([20, 20], 1024, seed=22)
    params = greedy(max_tokens=8, logprobs=1)
    results: dict[str, Result] = {}
    engine.add_request("a", a, params)
    drive(engine, results)
    engine.add_request("b", b, params)
    drive(engine, results)
    assert engine.stats().prefix_hit_tokens == 0
    fresh = partial(make_engine, tiny_llama, **engine_opts)
    assert_same_as_solo("b", results["b"], solo(fresh, b, params), params)


def test_tenant_salts_never_share_blocks(tiny_llama):
    """The same prompt under two cache salts: no hit across them, a hit within one."""
    engine = make_engine(tiny_llama, block_size=8, num_kv_blocks=64, max_num_batched_tokens=64)
    (prompt,) = random_prompts([30], 1024, seed=23)
    params = greedy(max_tokens=4)
    results: dict[str, Result] = {}
    engine.add_request("a", prompt, params, cache_salt="tenant-a")
    drive(engine, results)
    engine.add_request("b", prompt, params, cache_salt="tenant-b")
    drive(engine, results)
    assert engine.stats().prefix_hit_tokens == 0, "a block computed under one salt served another"
    engine.add_request("a2", prompt, params, cache_salt="tenant-a")
    drive(engine, results)
    assert engine.stats().prefix_hit_tokens == 29  # all but the last token (3 blocks and 5 of the 4th)
    assert results["a"].outputs[0].tokens == results["b"].outputs[0].tokens == results["a2"].outputs[0].tokens


def test_requests_admitted_in_one_step_share_the_prefix_its_first_one_computes(tiny_llama):
    """Four requests behind one 48-token prefix, added together: the first computes the prefix and
    the others, admitted after it in the same step, already share its blocks (each layer writes the
    step's K/V before any attention reads it). Each gets its solo result."""
    engine_opts = dict(block_size=8, num_kv_blocks=128, max_num_batched_tokens=256)
    (prefix,) = random_prompts([48], 1024, seed=41)
    prompts = [prefix + own for own in random_prompts([5, 9, 3, 7], 1024, seed=42)]
    params = greedy(max_tokens=6, logprobs=1)
    engine = make_engine(tiny_llama, **engine_opts)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    results: dict[str, Result] = {}
    for d in engine.step():
        results.setdefault(d.request_id, Result()).add(d)
    assert engine.scheduler.running and len(engine.scheduler.running) == 4, "all four in the first step"
    assert engine.stats().prefix_hit_tokens == 3 * 48, "the three later ones hit the first one's blocks"
    drive(engine, results)
    assert_pool_whole(engine)
    fresh = partial(make_engine, tiny_llama, **engine_opts)
    for i, p in enumerate(prompts):
        assert_same_as_solo(str(i), results[str(i)], solo(fresh, p, params), params)


def test_logprobs_are_bitwise_after_a_preemption_mid_decode(tiny_llama):
    """A greedy request preempted after it has decoded tokens recomputes them as rows of a prefill
    chunk (the solo run computed them one by one as decodes): its logprobs must still be the solo
    run's bits, with prefix caching on (the recompute starts from a cache hit) and off."""
    p1, p2 = random_prompts([40, 50], 1024, seed=5)
    for caching in (True, False):
        engine_opts = dict(
            block_size=8, num_kv_blocks=14, max_num_batched_tokens=32, enable_prefix_caching=caching
        )
        requests = {
            "a": (p1, greedy(max_tokens=40, logprobs=2)),
            "b": (p2, greedy(max_tokens=40, logprobs=2)),
        }
        engine = make_engine(tiny_llama, **engine_opts)
        mid_decode = []
        preempt = engine.scheduler._preempt

        def observe(seq, out, preempt=preempt, mid_decode=mid_decode):
            if seq.num_computed_tokens > seq.request.num_prompt_tokens:
                mid_decode.append(seq.request.request_id)
            preempt(seq, out)

        engine.scheduler._preempt = observe
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        results: dict[str, Result] = {}
        drive(engine, results)
        assert mid_decode, f"caching={caching}: no request was preempted after decoding"
        assert_pool_whole(engine)
        fresh = partial(make_engine, tiny_llama, **engine_opts)
        for rid in set(mid_decode):
            prompt, params = requests[rid]
            ref = solo(fresh, prompt, params)
            assert_same_as_solo(rid, results[rid], ref, params)
            got = [lp.logprob for lp in results[rid].outputs[0].logprobs]
            assert got == [lp.logprob for lp in ref.outputs[0].logprobs], f"caching={caching}: {rid}"
