"""A step's seats (``max_seqs_per_step``), without a model: when more sequences run than a step
computes, the seats go round the clients, so one client's hundreds of streams cannot slow another
client's stream to one token every few steps, and each of its own streams gets an equal turn."""

from __future__ import annotations

from collections import Counter

from engine_svc import EngineConfig
from engine_svc.kv_cache_manager import KVCacheManager
from engine_svc.scheduler import Scheduler
from tests.test_step_contract import add, fake_result

BS = 16


def make(cap: int, policy: str = "fcfs", max_num_seqs: int = 256) -> Scheduler:
    config = EngineConfig(
        model="unused",
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_seqs_per_step=cap,
        max_num_batched_tokens=4096,
        scheduling_policy=policy,
    )
    return Scheduler(config, KVCacheManager(4096, BS, enable_prefix_caching=False))


def add_from(sched: Scheduler, client: str, rid: str, priority: int = 0):
    request = add(sched, rid, [3 + len(rid), 4, 5, 6], max_tokens=1000, ignore_eos=True)
    request.client = client
    request.priority = priority
    return request


def run(sched: Scheduler, steps: int) -> list[list[str]]:
    """The request ids each step computed for sequences that were running before it."""
    seen = []
    for _ in range(steps):
        before = {id(s) for s in sched.running}
        out = sched.schedule()
        seen.append([s.request.request_id for s in out.seqs if id(s) in before])
        sched.update_from_output(out, fake_result(out))
    return seen


def settle(sched: Scheduler) -> None:
    """Until every sequence is running and decoding."""
    while sched.waiting.ready or any(
        s.num_computed_tokens < s.request.num_prompt_tokens for s in sched.running
    ):
        out = sched.schedule()
        sched.update_from_output(out, fake_result(out))


def test_a_lone_clients_stream_takes_every_step_beside_a_flood():
    sched = make(cap=8)
    for k in range(100):
        add_from(sched, "flood", f"f{k}")
    settle(sched)
    add_from(sched, "normal", "n")
    seen = run(sched, 40)
    # Admitted at the first of those steps, then computed in every step after it.
    assert all("n" in step for step in seen[1:])
    assert all(len(step) <= 8 for step in seen)  # no step computes more running sequences than its seats
    # The flood's streams take turns: each gets an equal share (within one) of what is left.
    turns = Counter(rid for step in seen[1:] for rid in step if rid != "n")
    assert len(turns) == 100 and max(turns.values()) - min(turns.values()) <= 1


def test_clients_share_the_seats_by_rounds_not_by_how_many_streams_they_have():
    sched = make(cap=6)
    for k in range(30):
        add_from(sched, "a", f"a{k}")
    for k in range(2):
        add_from(sched, "b", f"b{k}")
    for k in range(20):
        add_from(sched, "c", f"c{k}")
    settle(sched)
    for step in run(sched, 30):
        per_client = Counter(rid[0] for rid in step)
        assert per_client == {"a": 2, "b": 2, "c": 2}, step


def test_under_the_priority_policy_the_urgent_are_seated_first():
    sched = make(cap=4, policy="priority")
    for k in range(10):
        add_from(sched, "flood", f"f{k}", priority=5)
    add_from(sched, "flood", "urgent", priority=-1)
    settle(sched)
    seen = run(sched, 20)
    assert all("urgent" in step for step in seen)


def test_every_running_sequence_steps_while_the_seats_suffice():
    sched = make(cap=64)
    for k in range(40):
        add_from(sched, f"client{k % 3}", f"r{k}")
    settle(sched)
    for step in run(sched, 5):
        assert len(step) == 40


def test_paused_sequences_take_no_seat():
    sched = make(cap=4)
    stalled = [add_from(sched, "flood", f"f{k}") for k in range(10)]
    add_from(sched, "x", "x1")
    add_from(sched, "x", "x2")
    settle(sched)
    for request in stalled[:8]:
        sched.set_paused(request, True)
    for step in run(sched, 6):
        assert sorted(step) == ["f8", "f9", "x1", "x2"]


def admitted_in_each_step(sched: Scheduler, steps: int) -> list[list[str]]:
    """The request ids each step admitted (sequences waiting before it, computed in it)."""
    seen = []
    for _ in range(steps):
        before = {id(s) for s in sched.waiting.ready}
        out = sched.schedule()
        seen.append([s.request.request_id for s in out.seqs if id(s) in before])
        sched.update_from_output(out, fake_result(out))
    return seen


def test_a_burst_is_admitted_a_seat_at_a_time_not_all_in_one_step():
    """Admissions take seats like running sequences: a burst of short prompts, which the token
    budget alone would admit in one step, comes in over several, no step computing more than its
    seats."""
    sched = make(cap=8)
    for k in range(30):
        add_from(sched, "flood", f"f{k}")
    counts = []
    for _ in range(12):
        out = sched.schedule()
        assert len(out.seqs) <= 8
        counts.append(sum(1 for s in out.seqs if s.num_computed_tokens == 0))
        sched.update_from_output(out, fake_result(out))
    assert counts[:3] == [8, 8, 8] and sum(counts) == 30
    # Waiting before running within the client: the burst's first 8 sat out while the rest came in.
    assert not sched.waiting.ready


def test_a_new_clients_request_is_admitted_next_step_beside_another_clients_queue():
    """The waiting queue is first come first served within a client, not across clients: a
    request that arrives behind another client's 200 queued prompts takes the next step's seat."""
    sched = make(cap=8)
    for k in range(200):
        add_from(sched, "flood", f"f{k}")
    run(sched, 2)  # the flood is queued and partly running
    assert len(sched.waiting.ready) > 150
    add_from(sched, "normal", "n")
    seen = admitted_in_each_step(sched, 1)
    assert "n" in seen[0] and len(seen[0]) <= 8
    # ... and computed in every step after it, as the flood keeps coming in and taking turns.
    for step in run(sched, 20):
        assert "n" in step and len(step) <= 8


def test_a_sequence_waiting_for_its_grammar_takes_no_seat():
    from concurrent.futures import Future

    sched = make(cap=4)
    compiling = add_from(sched, "g", "grammar")
    compiling.grammar = Future()  # never done in this test
    for k in range(6):
        add_from(sched, f"c{k}", f"r{k}")
    out = sched.schedule()
    assert len(out.seqs) == 4 and "grammar" not in [s.request.request_id for s in out.seqs]


def test_seats_given_to_waiting_sequences_that_cannot_come_in_go_back_to_the_running():
    """A waiting sequence seated while ``max_num_seqs`` or a dry pool keeps it out must not keep
    the running ones (whose end would let it in) out of every step: everything finishes."""
    for config in ({"max_num_seqs": 3}, {"blocks": 6}):
        blocks = config.get("blocks", 4096)
        sched = Scheduler(
            EngineConfig(
                model="unused",
                block_size=BS,
                max_num_seqs=config.get("max_num_seqs", 256),
                max_seqs_per_step=2,
                max_num_batched_tokens=4096,
            ),
            KVCacheManager(blocks, BS, enable_prefix_caching=False),
        )
        requests = []
        for k in range(8):
            requests.append(add(sched, f"r{k}", [3 + k, 4, 5, 6], max_tokens=20, ignore_eos=True))
            requests[-1].client = f"c{k % 3}"
        for _ in range(400):
            if all(r.finished for r in requests):
                break
            out = sched.schedule()
            sched.update_from_output(out, fake_result(out))
        assert all(r.finished for r in requests), config


def test_the_default_seats_a_step():
    import torch

    from engine_svc.engine import seqs_per_step

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    config = EngineConfig(model="unused")
    assert seqs_per_step(config, cpu, threads=1) == 16
    assert seqs_per_step(config, cpu, threads=2) == 32
    assert seqs_per_step(config, cpu, threads=8) == 128
    assert seqs_per_step(config, cpu, threads=64) == 256  # never more than run at once
    assert seqs_per_step(EngineConfig(model="unused", max_num_seqs=8), cpu, threads=2) == 8
    assert seqs_per_step(config, cuda) == 256
    assert seqs_per_step(EngineConfig(model="unused", max_seqs_per_step=5), cpu, threads=2) == 5
    try:
        EngineConfig(model="unused", max_seqs_per_step=0).validate()
    except ValueError as e:
        assert "max_seqs_per_step must be >= 1" in str(e)
    else:
        raise AssertionError("max_seqs_per_step=0 was accepted")
