"""The steady state's deltas (issue 41): when every sequence decoded last step and is scheduled
again in the same order, the output carries the one token each appended flat (``one_each``), taken
from the scheduler's update, with no per-sequence work in the builder. These check that form
against the sequences every step: taken exactly when it applies, never from a stale update, and
the builder's count of what the runner holds still right when a steady run ends (a sequence
finishes, another joins, one is preempted, an update is skipped)."""

from __future__ import annotations

from engine_svc.runner_state import RequestStates
from engine_svc.scheduler_output import CachedRequestData, SchedulerOutput
from tests.test_step_contract import add, fake_result, make_scheduler


def _check(sched, out, follower: RequestStates, sent: dict[int, int]) -> bool:
    """The output's deltas are the tokens each sequence appended since the runner last heard of
    it, in whichever form; the follower then holds each sequence as the scheduler does."""
    plain = out.output
    cached = plain.cached
    for seq_id, tokens in zip(cached.seq_ids, cached.new_token_ids, strict=True):
        seq = next(s for s in out.seqs if s.seq_id == seq_id)
        assert tokens == seq.token_ids[sent[seq_id] :], f"sequence {seq_id}'s delta"
    for seq_id in plain.released:
        sent.pop(seq_id, None)
    states = follower.follow(plain)
    assert [s.seq_id for s in states] == plain.seq_ids
    for seq in out.seqs:
        state = follower[seq.seq_id]
        assert state.token_ids == seq.token_ids and state.num_computed_tokens == seq.num_computed_tokens
        sent[seq.seq_id] = len(seq.token_ids)
    # The wire carries the same data whatever the form (and the form never reaches it).
    assert SchedulerOutput.from_wire(plain.to_wire()).cached == cached
    return cached.one_each is not None


def test_steady_deltas_are_the_tokens_appended_and_the_count_survives_the_run():
    sched = make_scheduler(num_blocks=40, block_size=4, budget=64)
    add(sched, "a", [3, 4, 5, 6, 7], max_tokens=30)
    add(sched, "b", [8, 9, 10], max_tokens=12)  # ends mid-run: the steady run ends with it
    follower, sent = RequestStates(), {}
    steady = []
    for step in range(60):
        if step == 20:
            add(sched, "c", [11, 12, 13, 14], max_tokens=10)  # joins: a prompt step, then steady again
        out = sched.schedule()
        if not out.seqs:
            break
        steady.append(_check(sched, out, follower, sent))
        if step == 25:
            out2 = sched.schedule()  # planned again with no update between: no stale deltas
            assert out2.output.cached.one_each is None
            steady.append(_check(sched, out2, follower, sent))
            out = out2
        sched.update_from_output(out, fake_result(out, token=20 + step))
    # Steady steps happened, and so did the steps around them that are not.
    assert steady.count(True) > 20 and steady.count(False) > 3, steady


def test_a_preemption_ends_the_steady_run():
    sched = make_scheduler(num_blocks=9, block_size=4, budget=64)
    for i in range(3):
        add(sched, f"r{i}", [3 + i] * 6, max_tokens=14)
    follower, sent = RequestStates(), {}
    steady, preempted = [], 0
    for step in range(80):
        out = sched.schedule()
        if not out.seqs:
            break
        preempted += len(out.preempted)
        steady.append(_check(sched, out, follower, sent))
        sched.update_from_output(out, fake_result(out, token=30 + step % 5))
    assert preempted and steady.count(True) > 3, (preempted, steady)


def test_either_form_is_the_same_data():
    flat = CachedRequestData([4, 5], None, [9, 3], one_each=[7, 8])
    assert flat == CachedRequestData([4, 5], [[7], [8]], [9, 3])
    assert flat != CachedRequestData([4, 5], [[7], [9]], [9, 3])
    assert flat.new_token_ids == [[7], [8]]


def test_a_steady_decode_step_leaves_the_garbage_collector_alone():
    """A steady step at 256 running allocates its per-sequence objects so that few are alive at
    once: building the update's 2 x 256 one-token lists up front (a list comprehension, where a
    generator makes them one at a time) made a generation-0 collection nearly every step."""
    import gc

    from benchmarks import common, step_overhead

    w = dict(step_overhead.QUICK, prompt_len=8, stub_cost_s=0.0)
    engine, _, _ = step_overhead.decode_engine(common.model_dir(True), 256, w)
    counts = [0, 0, 0]

    def count(phase, info):
        if phase == "stop":
            counts[info["generation"]] += 1

    gc.collect()
    gc.callbacks.append(count)
    try:
        for _ in range(40):
            engine.step()
    finally:
        gc.callbacks.remove(count)
    assert counts[0] <= 10, f"{counts[0]} generation-0 collections in 40 steady steps at 256 running"
