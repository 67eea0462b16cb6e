"""Requests that arrive together with one long prefix compute it once, without a model.

The second request waits (unadmitted, holding no blocks) while the first computes the blocks it
would otherwise compute itself, then hits them in the prefix cache: counted here in the tokens each
sequence is scheduled to compute. The wait ends whatever happens to the first: aborted, preempted
(the pool full), or paused; and it never keeps decodes out of a step."""

from __future__ import annotations

from engine_svc.scheduler import Scheduler
from tests.test_step_contract import add, fake_result, make_scheduler

BS = 8
SHARED = list(range(3, 3 + 40 * BS))  # 40 full blocks: a "system prompt" of 320 tokens
# A step's work budget (step_cost.py) as the engine sets one: a chunk deep in a prompt gets fewer
# tokens than the token budget, so another request is admitted beside it in the same step.
RATIO = 1 / 64


def make(**kw) -> Scheduler:
    return make_scheduler(block_size=BS, budget=64, attention_work_ratio=RATIO, **kw)


def run(sched: Scheduler, requests, on_step=None, max_steps=2000) -> dict[str, int]:
    """Steps until every request finished; the tokens each request's sequences were scheduled."""
    computed = {r.request_id: 0 for r in requests}
    for k in range(max_steps):
        if all(r.finished for r in requests):
            return computed
        if on_step is not None:
            on_step(k)
        out = sched.schedule()
        for seq, n in zip(out.seqs, out.num_new, strict=True):
            computed[seq.request.request_id] += n
        sched.update_from_output(out, fake_result(out))
        sched.check_invariants()
    raise AssertionError(f"not finished in {max_steps} steps: {computed}")


def test_the_second_of_two_arriving_together_computes_only_past_the_shared_prefix():
    sched = make(num_blocks=200)
    first = add(sched, "first", SHARED + [900, 901, 902], max_tokens=2)
    second = add(sched, "second", SHARED + [700, 701, 702, 703, 704], max_tokens=2)
    computed = run(sched, [first, second])
    # One decode step after the prompt (max_tokens=2): the first token comes from the prompt's step.
    assert computed["first"] == len(SHARED) + 3 + 1
    assert computed["second"] == 5 + 1, f"the second recomputed part of the shared prefix: {computed}"
    assert second.sequences[0].num_cached_tokens == len(SHARED) and sched.num_held > 0
    assert sched.kv.pool.num_used == 0


def test_a_request_that_cannot_use_the_cache_never_waits():
    sched = make(num_blocks=200)
    first = add(sched, "first", SHARED + [900], max_tokens=1)
    plp = add(sched, "plp", SHARED + [700], max_tokens=1, prompt_logprobs=0)
    computed = run(sched, [first, plp])
    assert sched.num_held == 0 and computed["plp"] == len(SHARED) + 1


def test_an_aborted_owner_releases_the_waiter_which_hits_what_it_had_computed():
    sched = make(num_blocks=200)
    first = add(sched, "first", SHARED + [900], max_tokens=2)
    second = add(sched, "second", SHARED + [700], max_tokens=2)
    owner = first.sequences[0]
    done_before_abort = []

    def abort_midway(k: int) -> None:
        if k == 3:
            assert sched.num_held > 0 and second.sequences[0].num_computed_tokens == 0
            done_before_abort.append(owner.num_computed_tokens)
            sched.abort(first, {0})

    computed = run(sched, [first, second], abort_midway)
    (done,) = done_before_abort
    assert 0 < done < len(SHARED)
    assert second.sequences[0].num_cached_tokens == done
    assert computed["second"] == len(SHARED) + 1 - done + 1
    assert sched.kv.pool.num_used == 0


def test_a_preempted_owner_never_leaves_the_waiter_waiting_on_a_full_pool():
    # A decoding stream, then two requests sharing a prefix that together fill the pool: the owner
    # is preempted when the stream needs a block; every request still finishes, nothing deadlocks.
    prompt_blocks = len(SHARED) // BS + 1
    sched = make(num_blocks=prompt_blocks + 4)  # the stream's 4, growing to 8
    stream = add(sched, "stream", list(range(2000, 2000 + 4 * BS - 1)), max_tokens=4 * BS)
    out = sched.schedule()  # its prompt, and its first token
    sched.update_from_output(out, fake_result(out, token=11))
    first = add(sched, "first", SHARED + [900, 901], max_tokens=3)
    second = add(sched, "second", SHARED + [700, 701], max_tokens=3)
    computed = run(sched, [stream, first, second])
    assert sched.num_held > 0 and sched.num_preemptions > 0
    assert computed["stream"] == 4 * BS - 1  # decodes all the way, never preempted (its prompt came first)
    assert sched.kv.pool.num_used == 0


def test_a_paused_owner_holds_no_one_and_decodes_are_never_kept_out():
    sched = make(num_blocks=200, max_num_seqs=8)
    stream = add(sched, "stream", list(range(2000, 2010)), max_tokens=200)
    out = sched.schedule()
    sched.update_from_output(out, fake_result(out, token=11))
    first = add(sched, "first", SHARED + [900], max_tokens=2)
    second = add(sched, "second", SHARED + [700], max_tokens=2)
    for _ in range(3):
        out = sched.schedule()
        assert stream.sequences[0] in out.seqs, "a decode was kept out of a step"
        assert second.sequences[0] not in out.seqs  # held while the first computes
        sched.update_from_output(out, fake_result(out, token=11))
    assert sched.num_held > 0
    sched.set_paused(first, True)
    out = sched.schedule()
    assert stream.sequences[0] in out.seqs and second.sequences[0] in out.seqs
    sched.update_from_output(out, fake_result(out, token=11))
