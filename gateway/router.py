"""Which engine replica gets a request: prefix affinity by rendezvous hashing, overruled by load.

Requests that share a prompt prefix should meet in one replica, where the first of them left the
prefix's KV blocks in the prefix cache. The affinity key is a hash of the prompt's first full
blocks (the engine's block size; a partial block is never cached, so it must not count) and of
the cache salt (tenants never share cache entries, so they gain nothing from meeting). Rendezvous
(highest-random-weight) hashing ranks the healthy replicas for that key: every gateway agrees on
the ranking without talking to the others, and when a replica leaves only the keys it owned move
(to their second choice); when it comes back, they return.

Affinity alone would pile a hot prefix onto one replica while another idles, so the ranking is
walked until a replica is not overloaded relative to the least-loaded one (by an absolute and a
relative margin, both). Walking the ranking rather than jumping to the least loaded keeps a
prefix's overflow on one consistent second replica, which then caches it too; with two replicas
the two rules are the same. A prompt shorter than one block has nothing to share: least loaded.

Pure logic, no I/O: the replica set feeds it load figures and obeys its answer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

AFFINITY, OVERFLOW, LEAST_LOADED = "affinity", "overflow", "least-loaded"


@dataclass(frozen=True)
class RoutingPolicy:
    prefix_blocks: int = 4  # full blocks of the prompt that make the affinity key
    balance_abs: float = 4.0  # a replica is overloaded when it carries this many more requests...
    balance_rel: float = 1.5  # ...and this many times the load of the least-loaded replica
    kv_weight: float = 4.0  # a full KV pool weighs as much as this many queued requests


@dataclass(frozen=True)
class ReplicaLoad:
    name: str
    inflight: int = 0  # requests this gateway has open on the replica: always current
    running: int = 0  # the engine's last heartbeat (every gateway's requests; stale while busy)
    waiting: int = 0
    kv_usage: float = 0.0  # blocks in use / blocks in the pool

    def score(self, policy: RoutingPolicy) -> float:
        # The heartbeat only comes when the engine's stream to us is quiet, so our own count is
        # the fresh figure; the engine's is the better one when other gateways share the replica.
        return max(self.inflight, self.running + self.waiting) + policy.kv_weight * self.kv_usage


class Choice(NamedTuple):
    name: str
    reason: str  # AFFINITY, OVERFLOW (a later rank of the key's ranking) or LEAST_LOADED


def prefix_key(prompt: Sequence[int], block_size: int, max_blocks: int, salt: str = "") -> bytes | None:
    """The affinity key of a prompt, or None when it has no full block to share."""
    n = min(len(prompt) // block_size, max_blocks) * block_size if block_size > 0 else 0
    if n == 0:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update(salt.encode())
    h.update(b"\0")
    h.update(array("q", prompt[:n]).tobytes())
    return h.digest()


def rendezvous_rank(key: bytes, names: Sequence[str]) -> list[str]:
    """Replica names from the key's first choice to its last (ties broken by name)."""

    def weight(name: str) -> bytes:
        return hashlib.blake2b(key + name.encode(), digest_size=8).digest()

    return sorted(names, key=lambda n: (weight(n), n), reverse=True)


def is_overloaded(candidate: ReplicaLoad, least: ReplicaLoad, policy: RoutingPolicy) -> bool:
    a, b = candidate.score(policy), least.score(policy)
    return a - b > policy.balance_abs and a > policy.balance_rel * b


def choose_replica(
    key: bytes | None, replicas: Sequence[ReplicaLoad], policy: RoutingPolicy, tiebreak: bytes = b""
) -> Choice:
    """The replica for a request; ``replicas`` are the healthy ones (at least one). ``tiebreak``
    (the request id) picks among equally loaded replicas, so that light traffic spreads too."""
    if not replicas:
        raise ValueError("no replica to choose from")
    order = {name: i for i, name in enumerate(rendezvous_rank(tiebreak, [r.name for r in replicas]))}
    least = min(replicas, key=lambda r: (r.score(policy), order[r.name]))
    if key is None:
        return Choice(least.name, LEAST_LOADED)
    by_name = {r.name: r for r in replicas}
    for rank, name in enumerate(rendezvous_rank(key, list(by_name))):
        if not is_overloaded(by_name[name], least, policy):
            return Choice(name, AFFINITY if rank == 0 else OVERFLOW)
    return Choice(least.name, LEAST_LOADED)  # unreachable: the least loaded is never overloaded


class RoundRobin:
    """The baseline the benchmark compares against: replicas in turn, prompts ignored."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[ReplicaLoad]) -> Choice:
        names = sorted(r.name for r in replicas)
        name = names[self._next % len(names)]
        self._next += 1
        return Choice(name, "round-robin")
