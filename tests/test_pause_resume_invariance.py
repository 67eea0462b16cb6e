"""A request paused and resumed (its client stopped reading, then read again) gets exactly its solo run.

While paused it takes no steps and, when the pool runs dry, it is the first preempted: its blocks go
back to the pool and its full blocks stay in the prefix cache, so the resume recomputes from a
cache hit. Whatever happened meanwhile, its tokens must equal those of the same request alone on a
fresh engine (DESIGN.md, "a request's output is its own"), and its logprobs bit for bit. Each
schedule below pauses the compared requests while neighbours fill a small pool, so the pause is also
a preemption, some of it while the request was still in its prompt.

The resume recomputes the output tokens that the solo run computed one by one as decodes as rows of
one prefill chunk: bitwise equality needs the attention kernel to sum a decode and a chunk's row in
the same order (kernels/cpu/native/paged_attention.c). Before it did, the logprobs were about 1e-6
off after a preemption (also with prefix caching off)."""

from __future__ import annotations

import random
from functools import partial

import pytest

from engine_svc import SamplingParams
from tests.differential import Result, assert_same_as_solo, solo
from tests.engine_helpers import assert_pool_whole, make_engine

VOCAB = 1024
ENGINE = dict(num_kv_blocks=24, block_size=16, max_num_batched_tokens=64, max_num_seqs=4)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paused_and_preempted_requests_equal_their_solo_runs(tiny_llama, seed):
    rng = random.Random(seed)
    factory = partial(make_engine, tiny_llama, **ENGINE)
    compared = {
        "greedy": (
            _prompt(rng, 40),
            SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5),
        ),
        "seeded": (
            _prompt(rng, 70),
            SamplingParams(
                temperature=0.9, top_p=0.95, seed=seed + 11, max_tokens=40, ignore_eos=True, logprobs=3
            ),
        ),
    }
    # Neighbours that need most of the pool (24 blocks of 16): whoever is paused must give way.
    neighbours = {
        f"n{i}": (
            _prompt(rng, rng.randrange(60, 120)),
            SamplingParams(max_tokens=rng.randrange(40, 90), ignore_eos=True),
        )
        for i in range(5)
    }
    # Per compared request: (step to pause at, steps paused), twice each.
    windows = {rid: sorted(rng.sample(range(1, 60), 2)) for rid in compared}
    lengths = {rid: [rng.randrange(5, 25) for _ in range(2)] for rid in compared}

    engine = factory()
    for rid, (prompt, params) in compared.items():
        engine.add_request(rid, prompt, params)
    results: dict[str, Result] = {}
    paused_until: dict[str, int] = {}
    preempted_while_paused = set()
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step == 2:
            for rid, (prompt, params) in neighbours.items():
                engine.add_request(rid, prompt, params)
        for rid in compared:
            if rid in paused_until and step >= paused_until[rid]:
                del paused_until[rid]
                engine.resume_request(rid)
            for start, length in zip(windows[rid], lengths[rid], strict=True):
                if step == start and rid in engine.requests:
                    engine.pause_request(rid)
                    paused_until[rid] = step + length
        for d in engine.step():
            assert d.request_id not in paused_until, f"{d.request_id} was stepped while paused"
            results.setdefault(d.request_id, Result()).add(d)
        engine.check_invariants()
        for rid in paused_until:
            request = engine.requests.get(rid)
            if request is not None and not engine.kv.block_table(request.sequences[0]):
                preempted_while_paused.add(rid)
        assert step < 5000, "the engine did not finish"
    assert preempted_while_paused, "no paused request gave up its blocks: the schedule tests nothing"
    assert engine.stats().prefix_hit_tokens > 0, "no resume recomputed from the prefix cache"
    assert_pool_whole(engine)
    for rid, (prompt, params) in compared.items():
        ref = solo(factory, prompt, params)
        assert assert_same_as_solo(rid, results[rid], ref, params) is None
        assert results[rid].outputs[0].tokens == ref.outputs[0].tokens, rid
        got_lp = [lp.logprob for lp in results[rid].outputs[0].logprobs]
        assert got_lp == [lp.logprob for lp in ref.outputs[0].logprobs], f"{rid}: logprobs not bitwise"
