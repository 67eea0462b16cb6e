"""The waiting queues against a model written another way: a plain list of every queued sequence
with its place, sorted on each read, and a set of paused requests filtered out on each read.
Random operations (arrive, preempted back, admit the j-th ready, remove anywhere, pause, resume,
end) must leave the queue handing out exactly what the model says, in the model's order."""

from __future__ import annotations

import random

import pytest

from engine_svc import SamplingParams
from engine_svc.request_queue import FcfsQueue, PriorityQueue
from engine_svc.sequence import Request, Sequence


class ModelQueue:
    """Every queued sequence with its place: FCFS by the time it entered (a preempted one before
    everything queued then, as it was the oldest work); priority by (priority, arrival, index)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.entries: list[tuple[tuple, Sequence]] = []
        self.paused: set[int] = set()  # id() of paused requests
        self.clock = 0

    def place(self, seq: Sequence, preempted: bool) -> tuple:
        self.clock += 1
        if self.policy == "priority":
            return (seq.request.priority, seq.request.arrival, seq.index)
        return (-self.clock,) if preempted else (self.clock,)

    def add(self, seq, preempted=False):
        self.entries.append((self.place(seq, preempted), seq))

    def ready(self) -> list[Sequence]:
        ordered = sorted(self.entries, key=lambda e: e[0])
        return [s for _, s in ordered if id(s.request) not in self.paused]

    def remove(self, seq):
        self.entries = [e for e in self.entries if e[1] is not seq]


def new_request(rid: int, priority: int, n: int) -> Request:
    p = SamplingParams(n=n, max_tokens=4)
    request = Request(f"r{rid}", [5, 6, 7], p, priority, None, rid, 4)
    request.sequences = [Sequence(request, i, [5, 6, 7]) for i in range(n)]
    return request


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_sorted_list_model(policy, seed):
    rng = random.Random(seed)
    queue = FcfsQueue() if policy == "fcfs" else PriorityQueue()
    model = ModelQueue(policy)
    requests: list[Request] = []
    outside: list[Sequence] = []  # "running": taken from the queue, may come back preempted
    for _ in range(400):
        op = rng.random()
        queued = [s for _, s in model.entries]
        if op < 0.25 or not (queued or outside):
            r = new_request(len(requests), rng.randint(-2, 2), rng.choice([1, 1, 2]))
            requests.append(r)
            for seq in r.sequences[:1]:  # forks happen while running; index 0 enters
                queue.push(seq)
                model.add(seq)
            outside.extend(r.sequences[1:])  # the other indexes "running" after a fork
        elif op < 0.45 and model.ready():
            j = rng.randrange(len(model.ready()))
            want = model.ready()[j]
            assert queue.take(j) is want
            model.remove(want)
            outside.append(want)
        elif op < 0.6 and outside:
            seq = outside.pop(rng.randrange(len(outside)))
            queue.requeue(seq)
            model.add(seq, preempted=True)
        elif op < 0.7 and queued:
            seq = rng.choice(queued)
            queue.discard(seq)
            model.remove(seq)
        elif op < 0.85 and requests:
            r = rng.choice(requests)
            queue.pause(r)
            model.paused.add(id(r))
        elif requests:
            r = rng.choice(requests)
            queue.resume(r)
            model.paused.discard(id(r))
        assert queue.ready == model.ready()
        assert len(queue) == len(model.entries)
        assert {id(s) for s in queue} == {id(s) for _, s in model.entries}


def test_a_paused_request_is_not_handed_out_until_resumed_and_keeps_its_place():
    queue = FcfsQueue()
    a, b, c = (new_request(i, 0, 1) for i in range(3))
    for r in (a, b, c):
        queue.push(r.sequences[0])
    queue.pause(b)
    assert queue.ready == [a.sequences[0], c.sequences[0]] and len(queue) == 3
    queue.requeue(queue.take(0))  # a preempted while b is paused: to the front
    queue.resume(b)
    assert queue.ready == [a.sequences[0], b.sequences[0], c.sequences[0]]


def test_priority_lower_value_first_ties_by_arrival():
    queue = PriorityQueue()
    late_urgent, early_normal, late_normal = new_request(2, -1, 1), new_request(0, 0, 1), new_request(1, 0, 1)
    for r in (late_normal, late_urgent, early_normal):
        queue.push(r.sequences[0])
    assert [s.request for s in queue.ready] == [late_urgent, early_normal, late_normal]
