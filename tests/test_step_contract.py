"""The step contract without a model: the scheduler plans a step and applies fake results.

``Scheduler.schedule`` says what each sequence computes and lays out the logits rows;
``Scheduler.update_from_output`` applies a ``StepResult`` (sampled tokens per sample row, prompt
logprobs per chunk). These tests drive it with made-up tokens, as vLLM's ``tests/v1/core`` does, and
check counters, rows, forks, stops, aborts, pauses, preemption and prefix hits exactly. The last
test proves the runner's decode-only input path equal to its general one on a real engine.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine_svc import EngineConfig, SamplingParams
from engine_svc.kv_cache_manager import KVCacheManager
from engine_svc.logits_layout import StepResult
from engine_svc.outputs import TokenLogprob
from engine_svc.runner_state import RequestState, RequestStates
from engine_svc.scheduler import Scheduler
from engine_svc.sequence import FinishReason, Request, Sequence
from engine_svc.spec_decode.config import SpeculativeConfig
from tests.engine_helpers import make_engine, random_prompts

arrivals = itertools.count()


def make_scheduler(num_blocks=64, block_size=8, budget=32, **kw) -> Scheduler:
    config = EngineConfig(model="unused", block_size=block_size, max_num_batched_tokens=budget, **kw)
    spec = SpeculativeConfig.parse(config.speculative_config)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=True), spec)


def add(sched: Scheduler, rid: str, prompt: list[int], **params) -> Request:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 4, **params})
    p.eos_token_ids = (2,)
    request = Request(rid, prompt, p, 0, None, next(arrivals), p.max_tokens)
    seq = Sequence(request, 0, list(prompt))
    request.sequences.append(seq)
    sched.add(seq)
    return request


def fake_result(out, token=7) -> StepResult:
    """``token`` for every sample row (row r gets token + r when sampling n at a fork); no drafts
    (``with_drafts`` adds a real proposer's)."""
    layout = out.layout
    tokens = []
    for fan in layout.fans:
        tokens += [token + j for j in range(fan)]
    plps = [
        [TokenLogprob(c.seq.token_ids[c.first + 1 + i], -1.0, 1) for i in range(c.count)]
        for c in layout.prompt_chunks
    ]
    return StepResult(tokens, [None] * len(tokens), plps)


def with_drafts(result: StepResult, out, proposer) -> StepResult:
    """``result`` with the drafts ``proposer`` makes after its tokens, as the runner adds them: the
    proposer reads the step's plain output and the runner's record of each scheduled sequence (as
    it stands before the step's tokens: made here from the scheduler's sequences)."""
    states = RequestStates()
    for seq in out.seqs:
        r = seq.request
        states[seq.seq_id] = RequestState(
            seq.seq_id,
            r.request_id,
            seq.index,
            list(seq.token_ids),
            r.num_prompt_tokens,
            seq.num_computed_tokens,
            r.length_limit,
            r.params,
            0,
        )
    result.drafts = proposer.propose(out.output, result.token_ids, states, None)
    return result


def step(sched, token=7):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_result(out, token))


def test_chunks_advance_the_counter_exactly_and_sample_only_at_the_end():
    sched = make_scheduler(budget=16)
    request = add(sched, "a", list(range(3, 43)))  # 40 tokens: chunks of 16, 16, 8
    seq = request.sequences[0]
    for expected in (16, 32):
        out, deltas = step(sched)
        assert out.num_new == [16] and seq.num_computed_tokens == expected
        assert deltas == [] and out.layout.num_sample_rows == 0
    out, deltas = step(sched)
    assert out.num_new == [8] and seq.num_computed_tokens == 40
    assert [d.new_token_ids for d in deltas] == [[7]] and seq.token_ids[-1] == 7
    out, deltas = step(sched, token=9)
    assert out.only_decodes and out.num_new == [1] and seq.token_ids[-2:] == [7, 9]


def test_layout_puts_every_sample_row_before_prompt_logprob_rows():
    sched = make_scheduler(budget=64)
    add(sched, "plp", list(range(3, 13)), prompt_logprobs=1)  # 10 tokens, rows 0..9 in the batch
    add(sched, "b", list(range(20, 28)))  # 8 tokens, rows 10..17
    out = sched.schedule()
    layout = out.layout
    assert [s.request.request_id for s in layout.sampled] == ["plp", "b"]
    assert layout.num_sample_rows == 2
    assert layout.token_rows.tolist() == [9, 17, *range(0, 9)]
    (chunk,) = layout.prompt_chunks
    assert (chunk.first, chunk.count, chunk.row) == (0, 9, 2)
    deltas = sched.update_from_output(out, fake_result(out))
    plp = deltas[0].prompt_logprobs
    assert plp[0] is None and [e.token_id for e in plp[1:]] == list(range(4, 13))
    assert deltas[1].prompt_logprobs is None


def test_a_fork_shares_blocks_and_each_sequence_gets_its_own_first_token():
    sched = make_scheduler()
    request = add(sched, "n3", list(range(3, 15)), n=3, temperature=1.0)
    out, deltas = step(sched, token=100)
    assert out.layout.fans == [3]
    assert [(d.index, d.new_token_ids) for d in deltas] == [(0, [100]), (1, [101]), (2, [102])]
    tables = [sched.kv.block_table(s) for s in request.sequences]
    assert tables[0] == tables[1] == tables[2], "the forks share every block by reference"
    for block_id in tables[0]:
        assert sched.kv.pool.blocks[block_id].ref_count == 3
    out, _ = step(sched)
    # The first write into the shared partial block copies it for all but its last holder.
    assert len(out.copies) == 2  # the step that writes carries the copies
    assert len({sched.kv.block_table(s)[-1] for s in request.sequences}) == 3


def test_one_stop_rule_min_tokens_length_and_request_finished():
    sched = make_scheduler()
    request = add(sched, "s", [3, 4, 5], max_tokens=3, min_tokens=2, stop_token_ids=[7])
    _, deltas = step(sched, token=7)  # a stop id before min_tokens is not a stop
    assert deltas[0].finish_reason is None
    _, deltas = step(sched, token=7)
    assert deltas[0].finish_reason == FinishReason.STOP and deltas[0].stop_token_id == 7
    assert deltas[0].request_finished and request.finished
    request = add(sched, "l", [3, 4, 5], max_tokens=2)
    step(sched, token=50)
    _, deltas = step(sched, token=51)
    assert deltas[0].finish_reason == FinishReason.LENGTH and deltas[0].request_finished
    assert not sched.running and sched.kv.pool.num_used == 0


def test_request_finished_only_on_the_last_output_of_a_fork():
    sched = make_scheduler()
    request = add(sched, "n2", [3, 4, 5], n=2, temperature=1.0, max_tokens=2)
    step(sched)
    sched.abort(request, {1})
    _, deltas = step(sched)
    assert [(d.index, d.finish_reason, d.request_finished) for d in deltas] == [(0, "length", True)]


def test_abort_of_sequence_zero_before_the_fork_forks_the_rest():
    sched = make_scheduler(budget=8)
    request = add(sched, "n3", list(range(3, 23)), n=3, temperature=1.0)
    step(sched)  # 8 of 20 prompt tokens
    sched.abort(request, {0})
    assert request.sequences[0].finish_reason is None, "sequence 0 still carries the prompt"
    step(sched)
    _, deltas = step(sched, token=100)
    assert [(d.index, d.new_token_ids) for d in deltas] == [(1, [101]), (2, [102])]
    assert request.sequences[0].finish_reason == FinishReason.ABORT
    assert {s.index for s in sched.running} == {1, 2}


def test_a_paused_request_takes_no_steps_and_gives_up_its_blocks_first():
    sched = make_scheduler(num_blocks=6, budget=64)
    slow = add(sched, "slow", list(range(3, 19)), max_tokens=20)  # 2 blocks
    step(sched)
    sched.set_paused(slow, True)
    fast = add(sched, "fast", list(range(30, 54)), max_tokens=20)  # 3 blocks, then a 4th
    for _ in range(10):
        out, _ = step(sched)
        assert all(s.request is fast for s in out.seqs), "a paused request was stepped"
    assert sched.num_preemptions == 1 and slow.sequences[0].num_computed_tokens == 0
    sched.set_paused(slow, False)
    while not slow.finished:
        step(sched)


def test_preemption_releases_and_recompute_restarts_from_zero_or_the_cache():
    sched = make_scheduler(num_blocks=5, budget=64)
    a = add(sched, "a", list(range(3, 19)), max_tokens=16)  # 2 blocks, growing to 4
    b = add(sched, "b", list(range(30, 46)), max_tokens=16)
    step(sched)
    preempted = []
    while not (a.finished and b.finished):
        out, _ = step(sched)
        preempted += [s.request.request_id for s in out.preempted]
        for s in out.preempted:
            assert s.num_computed_tokens == 0 and not sched.kv.block_table(s)
        sched.kv.pool.check_invariants()
    assert preempted and preempted[0] == "b", "the most recently admitted running sequence goes first"
    assert sched.kv.hit_tokens > 0, "the recompute took its own published blocks from the cache"
    assert sched.kv.pool.num_used == 0


def test_a_prefix_hit_starts_the_counter_at_the_hit():
    sched = make_scheduler(budget=64)
    prompt = list(range(3, 30))  # 27 tokens: 3 full blocks of 8
    add(sched, "first", prompt, max_tokens=1)
    step(sched)
    second = add(sched, "second", prompt, max_tokens=1)
    out = sched.schedule()
    # Never the last token: it must be computed to have logits to sample from.
    assert second.sequences[0].num_cached_tokens == 24 and out.num_new == [3]


def test_decode_only_inputs_equal_the_general_path(tiny_llama):
    """The runner's short path for all-decode steps builds exactly what its general path builds."""
    engine = make_engine(tiny_llama, block_size=8, num_kv_blocks=200, max_num_batched_tokens=64)
    runner, compared = engine.runner, [0]
    build = runner.build_inputs

    def both(out, states):
        inputs = build(out, states)
        if out.only_decodes:
            general = runner.general_inputs(out, states)
            for name in (
                "input_ids",
                "positions",
                "slots",
                "block_tables",
                "seq_lens",
                "query_start",
                "copies",
            ):
                a, b = getattr(inputs, name, None), getattr(general, name, None)
                assert a is not None and np.array_equal(a, b), name
            assert np.array_equal(inputs.logit_rows, general.logit_rows)
            assert (inputs.max_query_len, inputs.max_seq_len) == (general.max_query_len, general.max_seq_len)
            compared[0] += 1
        return inputs

    runner.build_inputs = both
    for i, prompt in enumerate(random_prompts([5, 17, 30, 9], 1024, seed=3)):
        engine.add_request(
            f"d{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
    assert compared[0] > 5


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_nothing_is_left_behind(policy):
    sched = make_scheduler(num_blocks=8, budget=16, scheduling_policy=policy)
    requests = [
        add(sched, f"r{i}", list(range(3 + i, 20 + 2 * i)), max_tokens=6, n=1 + i % 2) for i in range(5)
    ]
    for _ in range(500):
        if all(r.finished for r in requests):
            break
        step(sched)
    assert all(r.finished for r in requests)
    assert not sched.running and not sched.waiting and sched.kv.pool.num_used == 0


def test_paused_requests_hold_no_seat_and_yield_their_blocks_to_newcomers():
    """A client that stops reading must not keep others out: paused sequences do not count toward
    max_num_seqs, and a waiting request that needs blocks preempts a paused one."""
    sched = make_scheduler(num_blocks=4, budget=64, max_num_seqs=2)
    stalled = [add(sched, f"s{i}", list(range(3, 19)), max_tokens=8) for i in range(2)]  # 2 blocks each
    step(sched)
    for r in stalled:
        sched.set_paused(r, True)
    fresh = add(sched, "fresh", list(range(30, 46)), max_tokens=4)
    out, _ = step(sched)
    assert [s.request for s in out.seqs] == [fresh], "a paused request kept the newcomer out"
    assert sched.num_preemptions >= 1 and not all(sched.kv.block_table(r.sequences[0]) for r in stalled)
    while not fresh.finished:
        step(sched)
    for r in stalled:
        sched.set_paused(r, False)
    for _ in range(100):
        if all(r.finished for r in stalled):
            break
        step(sched)
    assert all(r.finished for r in stalled) and sched.kv.pool.num_used == 0


def test_drafts_in_the_result_are_verified_by_the_next_step():
    """The runner's drafts (``StepResult.drafts``) wait on the sequence and the next schedule
    verifies them: its last token plus the drafts, one sample row each; the update accepts the
    drafts that equal the samples, then the bonus token, and keeps the new drafts."""

    spec = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)
    sched = make_scheduler(budget=32, speculative_config=spec)
    request = add(sched, "d", [3, 4, 5, 6, 3, 4], max_tokens=20)
    seq = request.sequences[0]
    out = sched.schedule()
    assert out.propose == {seq: 4}, "a prompt the step completes drafts after it"
    result = fake_result(out, token=7)
    result.drafts = {seq.seq_id: [8, 9, 10]}
    sched.update_from_output(out, result)
    assert seq.spec_token_ids == [8, 9, 10]
    out = sched.schedule()
    assert out.drafts == {seq: [8, 9, 10]} and out.num_new == [4] and out.layout.fans == [4]
    assert out.layout.token_rows.tolist() == [0, 1, 2, 3]
    result = StepResult([8, 9, 11, 12], [None] * 4, [], {seq.seq_id: [13]})
    (delta,) = sched.update_from_output(out, result)
    assert delta.new_token_ids == [8, 9, 11]  # two drafts accepted, then the bonus token
    assert seq.num_computed_tokens == 6 + 1 + 2 and seq.token_ids[6:] == [7, 8, 9, 11]
    assert (seq.num_drafted, seq.num_accepted) == (3, 2) and seq.spec_token_ids == [13]
    assert len(sched.kv.block_table(seq)) == -(-len(seq.token_ids) // 8), "n-gram keeps no lookahead"
    sched.check_invariants()
    out = sched.schedule()
    result = fake_result(out, token=40)  # rejects the draft; the proposer has nothing this time
    result.logprobs = [None] * len(result.token_ids)
    sched.update_from_output(out, result)
    assert out.drafts == {seq: [13]} and seq.token_ids[-1] == 40 and seq.spec_token_ids == []


def test_a_draft_models_lookahead_is_allocated_with_the_step_and_released_when_rejected():
    """A draft model writes its drafts' K/V in slots past the step's tokens: the scheduler
    allocates them with the step, the update keeps the blocks the held drafts lie in, and releases
    them once the drafts are rejected. The verification is cut to the step's budget."""

    spec = SpeculativeConfig(method="draft_model", model="unused", num_speculative_tokens=3, adaptive=False)
    sched = make_scheduler(budget=32, speculative_config=spec)
    request = add(sched, "m", [3, 4, 5, 6, 3, 4], max_tokens=20)
    seq = request.sequences[0]
    out = sched.schedule()
    assert out.num_new == [6] and out.propose == {seq: 3}
    assert len(sched.kv.block_table(seq)) == 2, "6 tokens + 3 lookahead slots: two blocks of 8"
    result = fake_result(out, token=7)
    result.drafts = {seq.seq_id: [20, 21, 22]}
    sched.update_from_output(out, result)
    assert len(sched.kv.block_table(seq)) == 2, "the drafts' K/V lie in the second block"
    sched.check_invariants()
    out = sched.schedule()
    assert out.drafts == {seq: [20, 21, 22]} and out.num_new == [4]
    result = StepResult([30, 31, 32, 33], [None] * 4, [], {})  # the first draft is wrong: all rejected
    (delta,) = sched.update_from_output(out, result)
    assert delta.new_token_ids == [30] and seq.spec_token_ids == []
    assert len(sched.kv.block_table(seq)) == 1, "8 tokens, no drafts: the lookahead block is released"
    sched.check_invariants()
    small = make_scheduler(budget=3, speculative_config=spec)
    request = add(small, "s", [3, 4, 5], max_tokens=20)
    out = small.schedule()
    result = fake_result(out)
    result.drafts = {request.sequences[0].seq_id: [1, 2, 3]}
    small.update_from_output(out, result)
    out = small.schedule()
    assert out.drafts == {request.sequences[0]: [1, 2]}, "verification is cut to the budget"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_step_takes_each_sequences_blocks_in_one_allocation(method):
    """Issue 41: ``schedule()`` plans a sequence's tokens, drafts and lookahead slots, then takes
    their blocks in one allocation; nothing allocates for it again in that step (a dry pool may
    refuse a plan, which takes nothing). Driven through verification, lookahead and preemption:
    every step's successful allocations are counted per sequence by a wrapper around the KV
    manager, an independent reader of what the scheduler asked for."""
    from engine_svc.spec_decode.proposer import NgramProposer

    spec = SpeculativeConfig(
        method=method,
        model="unused" if method == "draft_model" else None,
        num_speculative_tokens=3,
        prompt_lookup_min=1,
        prompt_lookup_max=2,
        adaptive=False,
    )
    sched = make_scheduler(num_blocks=14, block_size=4, budget=24, speculative_config=spec)
    proposer = NgramProposer(spec)
    taken: list[Sequence] = []
    allocate = sched.kv.allocate

    def counting(seq, *args, **kw):
        ok = allocate(seq, *args, **kw)
        if ok:
            taken.append(seq)
        return ok

    sched.kv.allocate = counting
    requests = [add(sched, f"r{i}", [5, 6, 7] * (3 + i), max_tokens=12) for i in range(4)]
    drafted = preempted = 0
    for _ in range(200):
        taken.clear()
        out = sched.schedule()
        twice = [s.seq_id for s in set(taken) if taken.count(s) > 1]
        assert not twice, f"sequences allocated more than once in one step: {twice}"
        drafted += bool(out.drafts)
        preempted += bool(out.preempted)
        result = fake_result(out, token=5)
        for seq, draft in out.drafts.items():  # the fake target accepts the first draft, then 8s
            j = out.layout.sampled.index(seq)
            row = sum(out.layout.fans[:j])
            result.token_ids[row : row + len(draft) + 1] = [draft[0]] + [8] * len(draft)
        sched.update_from_output(out, with_drafts(result, out, proposer))
        sched.check_invariants()
        if all(r.finished for r in requests):
            break
    assert all(r.finished for r in requests)
    assert drafted and preempted, (drafted, preempted)  # the test saw what it checks


def test_the_step_in_docs_engine_step_md():
    """docs/engine-step.md follows one step's data end to end; these are its numbers (the doc's
    reader and this test see the same run)."""
    from engine_svc.model_runner import ModelRunner
    from engine_svc.scheduler_output import SchedulerOutput
    from engine_svc.spec_decode.proposer import NgramProposer

    spec = SpeculativeConfig(
        num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2, adaptive=False
    )
    sched = make_scheduler(num_blocks=16, block_size=4, budget=8, speculative_config=spec)
    proposer = NgramProposer(spec)
    runner = ModelRunner(None, 4, 8, proposer=proposer)  # its state and inputs; no forward here
    a = add(sched, "a", [11, 12, 13, 11, 12], max_tokens=8).sequences[0]
    out = sched.schedule()
    runner.update_states(out.output)
    sched.update_from_output(out, with_drafts(fake_result(out, token=13), out, proposer))
    assert a.spec_token_ids == [11, 12]
    b = add(sched, "b", list(range(21, 30)), max_tokens=4).sequences[0]
    out = sched.schedule()
    # The scheduler's own record of the step.
    assert (out.seqs, out.num_new, out.drafts, out.propose) == ([a, b], [3, 5], {a: [11, 12]}, {a: 2})
    assert not out.only_decodes and not out.all_decoding
    # What the runner reads: plain data.
    plain = out.output
    assert (plain.seq_ids, plain.num_scheduled) == ([a.seq_id, b.seq_id], [3, 5])
    (new,) = plain.new
    assert (new.seq_id, new.request_id, new.token_ids, new.num_computed_tokens) == (
        b.seq_id,
        "b",
        list(range(21, 30)),
        0,
    )
    assert (new.num_prompt_tokens, new.length_limit, new.block_ids) == (9, 13, [[2, 3]])
    cached = plain.cached
    assert (cached.seq_ids, cached.new_token_ids, cached.num_computed_tokens) == ([a.seq_id], [[13]], [5])
    assert (plain.drafts, plain.propose) == ({a.seq_id: [11, 12]}, {a.seq_id: 2})
    assert (plain.updates, plain.released, plain.copies.shape, plain.forks) == ([], [], (0, 2), [])
    rows = plain.rows
    assert (rows.token_rows.tolist(), rows.sampled, rows.fans, rows.drafts) == (
        [0, 1, 2],
        [a.seq_id],
        [3],
        [[11, 12]],
    )
    wire = plain.to_wire()
    assert len(wire) == 78  # int64 words; SchedulerOutput.from_wire reads it back
    runner.update_states(SchedulerOutput.from_wire(wire))
    state_a, state_b = runner.requests[a.seq_id], runner.requests[b.seq_id]
    assert (state_a.token_ids, state_a.num_computed_tokens) == ([11, 12, 13, 11, 12, 13], 5)
    assert (state_b.token_ids, runner.batch.block_tables[runner.batch.row_of[b.seq_id], :2].tolist()) == (
        list(range(21, 30)),
        [2, 3],
    )
    inputs = runner.build_inputs(plain, [state_a, state_b])
    assert inputs.input_ids.tolist() == [13, 11, 12, 21, 22, 23, 24, 25]
    assert inputs.positions.tolist() == [5, 6, 7, 0, 1, 2, 3, 4]
    assert inputs.slots.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert inputs.block_tables.tolist() == [[0, 1], [2, 3]]
    assert (inputs.seq_lens.tolist(), inputs.query_start.tolist()) == ([8, 5], [0, 3, 8])
    assert inputs.logit_rows.tolist() == [0, 1, 2]
    result = with_drafts(StepResult([11, 12, 99], [None] * 3, []), out, proposer)
    assert result.drafts == {}
    (delta,) = sched.update_from_output(out, result)
    assert (delta.request_id, delta.new_token_ids) == ("a", [11, 12, 99])
    assert (a.num_computed_tokens, b.num_computed_tokens, a.spec_token_ids) == (8, 5, [])
    out = sched.schedule()
    plain = out.output
    assert [(u.seq_id, u.first, u.block_ids) for u in plain.updates] == [
        (a.seq_id, 2, [4]),
        (b.seq_id, 2, [5]),
    ]
    assert plain.cached.new_token_ids == [[11, 12, 99], []] and plain.cached.num_computed_tokens == [8, 5]
