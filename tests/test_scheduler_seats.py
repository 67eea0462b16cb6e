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


def test_the_default_seats_a_step():
    import torch

    from engine_svc.engine import seqs_per_step

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    config = EngineConfig(model="unused")
    assert seqs_per_step(config, cpu, threads=1) == 32  # the floor
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
