"""The scheduler's output is plain data and crosses a process boundary without pickle: a step planned
by a real scheduler (new requests, cached deltas, chunks, drafts, forks, preemptions, releases,
copy-on-write copies) survives its wire form field for field, and a runner record that follows the
decoded outputs holds exactly the scheduler's tokens and counters (checked against the sequences)."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_svc.runner_state import RequestStates
from engine_svc.scheduler_output import SchedulerOutput
from engine_svc.spec_decode.config import SpeculativeConfig
from engine_svc.spec_decode.proposer import NgramProposer
from tests.test_step_contract import add, fake_result, make_scheduler, with_drafts


def _same(a, b, path="out") -> None:
    """Field-by-field equality, arrays by value and dtype-free (the wire is int64)."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert np.array_equal(np.asarray(a), np.asarray(b)), path
        assert np.asarray(a).shape == np.asarray(b).shape, path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_every_step_round_trips_through_the_wire_and_the_runner_follows_it():
    spec = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, adaptive=False
    )
    sched = make_scheduler(num_blocks=14, block_size=4, budget=24, speculative_config=spec)
    proposer = NgramProposer(spec)
    requests = [
        add(sched, "cycle", [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=20, temperature=0.5, seed=3),
        add(sched, "fork", list(range(30, 41)), n=3, temperature=1.0, max_tokens=6, logit_bias={9: 1.5}),
        add(sched, "plp", list(range(50, 69)), max_tokens=5, prompt_logprobs=2, stop_token_ids=[4]),
        add(sched, "long", list(range(100, 140)), max_tokens=8, min_tokens=2),
    ]
    follower = RequestStates()  # a runner's record, fed only by decoded outputs
    seen = {"new": 0, "cached": 0, "drafts": 0, "forks": 0, "released": 0, "copies": 0, "preempted": 0}
    for step in range(200):
        out = sched.schedule()
        plain = out.output
        wire = plain.to_wire()
        assert wire.dtype == np.int64 and wire.ndim == 1
        back = SchedulerOutput.from_wire(wire)
        _same(plain, back)
        follower.follow(back)
        for seq in out.seqs:  # the runner holds the scheduler's view
            state = follower[seq.seq_id]
            assert state.token_ids == seq.token_ids and state.num_computed_tokens == seq.num_computed_tokens
            assert state.index == seq.index and state.length_limit == seq.request.length_limit
        assert not set(back.released) & set(follower), "a released sequence outlived its release"
        seen["new"] += len(back.new)
        seen["cached"] += len(back.cached.seq_ids)
        seen["drafts"] += len(back.drafts)
        seen["forks"] += len(back.forks)
        seen["released"] += len(back.released)
        seen["copies"] += len(back.copies)
        seen["preempted"] += len(out.preempted)
        sched.update_from_output(out, with_drafts(fake_result(out, token=5 + step % 3), out, proposer))
        if all(r.finished for r in requests):
            break
    assert all(r.finished for r in requests)
    assert all(seen.values()), seen  # the test saw what it checks


def test_a_new_requests_sampling_parameters_survive_the_wire():
    sched = make_scheduler()
    add(
        sched,
        "p",
        [1, 2, 3],
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        seed=2**40 + 3,
        logprobs=2,
        allowed_token_ids=[3, 4, 5],
        bad_words_token_ids=[[6, 7]],
        logit_bias={3: -2.5},
        min_tokens=1,
    )
    plain = sched.schedule().output
    (new,) = SchedulerOutput.from_wire(plain.to_wire()).new
    assert new.params == plain.new[0].params and new.params.eos_token_ids == (2,)
