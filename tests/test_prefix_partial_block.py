"""A prefix hit that goes on inside a block (``PartialHit``): a conversation's next turn shares the
tokens where the earlier turn's prompt ended, partway through a block the earlier turn filled.

The sequence takes a copy of that cached block and computes from the first token it does not
share; the cached block stays as it was. Checked against each request's solo run on a fresh engine
(no cache), and against the block itself: a later request that hits the whole cached block reads
what the first request computed, which a sequence writing into the block instead of its copy
would have overwritten."""

from __future__ import annotations

from functools import partial

from engine_svc import SamplingParams
from tests.differential import Result, assert_same_as_solo, drive, solo
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts

BS = 16
OPTS = dict(block_size=BS, num_kv_blocks=64, max_num_batched_tokens=512)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def run(engine, rid: str, prompt: list[int], params: SamplingParams, **kw) -> tuple[Result, int]:
    """One request alone on ``engine``: its result and the prompt tokens the cache gave it."""
    seen: list[int] = []
    schedule = engine.scheduler.schedule

    def observed():
        out = schedule()
        seen.extend(s.num_cached_tokens for s in out.seqs if s.request.request_id == rid)
        return out

    engine.scheduler.schedule = observed
    try:
        engine.add_request(rid, prompt, params, **kw)
        results: dict[str, Result] = {}
        drive(engine, results)
    finally:
        engine.scheduler.schedule = schedule
    assert_pool_whole(engine)
    return results[rid], seen[0]


def test_a_next_turn_reuses_the_tokens_it_shares_inside_a_block(tiny_llama):
    engine = make_engine(tiny_llama, **OPTS)
    fresh = partial(make_engine, tiny_llama, **OPTS)
    (prompt,) = random_prompts([37], 1024, seed=21)
    first, cached = run(engine, "turn1", prompt, greedy(20))
    assert cached == 0
    out = first.outputs[0].tokens
    # Its blocks 0-2 are full and published (block 2: prompt[32:37] + out[:11]); block 3 is not.
    turns = {
        # shares blocks 0, 1 and the first 10 tokens of block 2 (the prompt's 5, its first 5 outputs)
        "turn2": (prompt + out[:5] + random_prompts([7], 1024, seed=22)[0], 42),
        # the prompt itself again: its last token is always computed, so 36 of 37
        "again": (prompt, 36),
        # shares the whole of block 2: three whole blocks; the first turn's block 3 was never
        # full, so nothing goes on from there
        "whole": (prompt + out[:11] + [5, 6, 7], 48),
        # shares block 0 and 3 tokens of block 1
        "early": (prompt[:19] + [9] * 12, 19),
    }
    hits_before = engine.kv.num_partial_hits
    for rid, (p, want) in turns.items():
        params = greedy(6)
        got, cached = run(engine, rid, p, params)
        assert cached == want, f"{rid}: {cached} prompt tokens from the cache, expected {want}"
        assert_same_as_solo(rid, got, solo(fresh, p, params), params)
    assert engine.kv.num_partial_hits - hits_before == 3  # turn2, again, early: each a copy
    # The first turn again, whole: its blocks (block 2 above all) are what it computed.
    again, cached = run(engine, "turn1-again", prompt, greedy(20))
    assert cached == 36 and again.outputs[0].tokens == out


def test_a_partial_hit_is_salted_like_a_whole_one(tiny_llama):
    """Another cache salt (or adapter) is another chain: no block of the first is offered."""
    engine = make_engine(tiny_llama, **OPTS)
    (prompt,) = random_prompts([37], 1024, seed=23)
    run(engine, "a", prompt, greedy(20), cache_salt="alice")
    _, cached = run(engine, "b", prompt[:40] + [4, 4, 4], greedy(2), cache_salt="bob")
    assert cached == 0 and engine.kv.num_partial_hits == 0
    _, cached = run(engine, "c", prompt[:35] + [4, 4, 4], greedy(2), cache_salt="alice")
    assert cached == 35 and engine.kv.num_partial_hits == 1


def test_a_partial_hit_on_a_full_pool_takes_nothing_until_it_fits(tiny_llama):
    """Its copy is a block like any other: with the pool full the request waits (or preempts), and
    the cached block it names is never handed out as its own copy."""
    opts = dict(OPTS, num_kv_blocks=6, max_num_batched_tokens=64)
    engine = make_engine(tiny_llama, **opts)
    fresh = partial(make_engine, tiny_llama, **opts)
    (prompt,) = random_prompts([37], 1024, seed=24)
    first, _ = run(engine, "a", prompt, greedy(20))
    p = prompt + first.outputs[0].tokens[:3] + [8] * 20  # 60 tokens: 4 blocks, and 2 in the copy
    params = greedy(20)  # 80 tokens in all: 5 of the pool's 6 blocks
    got, cached = run(engine, "b", p, params)
    assert cached == 40 and engine.kv.num_partial_hits == 1
    assert_same_as_solo("b", got, solo(fresh, p, params), params)


def test_a_block_computed_by_the_same_step_is_shared_whole_never_copied(tiny_llama):
    """Two requests added together: the first's prompt blocks are published as its step is planned
    (so that the second, admitted after it in that step, shares them whole). A copy of one of them
    would be taken before the forward writes it: the second hits the whole blocks only, then
    computes the rest of its tokens itself. (Copying it gave the real model's chats garbage.)"""
    engine = make_engine(tiny_llama, **OPTS)
    fresh = partial(make_engine, tiny_llama, **OPTS)
    (prompt,) = random_prompts([50], 1024, seed=25)  # blocks 0-2 full, published as planned
    second = prompt[:40] + [7] * 5  # blocks 0-1 whole, then 8 tokens of block 2
    params = greedy(6)
    engine.add_request("first", prompt, params)
    engine.add_request("second", second, params)
    cached = {}
    schedule = engine.scheduler.schedule

    def observed():
        out = schedule()
        for s in out.seqs:
            cached.setdefault(s.request.request_id, s.num_cached_tokens)
        return out

    engine.scheduler.schedule = observed
    results: dict[str, Result] = {}
    drive(engine, results)
    assert_pool_whole(engine)
    assert cached == {"first": 0, "second": 32} and engine.kv.num_partial_hits == 0
    for rid, p in (("first", prompt), ("second", second)):
        assert_same_as_solo(rid, results[rid], solo(fresh, p, params), params)
    # Once computed, the same block is copied: a third request, after the step, hits 40 tokens.
    third, cached3 = run(engine, "third", prompt[:40] + [9] * 5, params)
    assert cached3 == 40 and engine.kv.num_partial_hits == 1
    assert_same_as_solo("third", third, solo(fresh, prompt[:40] + [9] * 5, params), params)
