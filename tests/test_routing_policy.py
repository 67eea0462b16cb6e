"""The router's pure logic: affinity keys, rendezvous ranking, and when load overrules affinity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.router import (
    AFFINITY,
    LEAST_LOADED,
    OVERFLOW,
    ReplicaLoad,
    RoundRobin,
    RoutingPolicy,
    choose_replica,
    is_overloaded,
    prefix_key,
    rendezvous_rank,
)

POLICY = RoutingPolicy()
names_st = st.lists(st.text("abcdef0123:.", min_size=1, max_size=12), min_size=1, max_size=6, unique=True)
tokens_st = st.lists(st.integers(0, 150_000), max_size=200)


@given(tokens_st, tokens_st, st.sampled_from([8, 16, 32]), st.integers(1, 4))
def test_key_depends_on_the_first_full_blocks_only(prompt, tail, block_size, max_blocks):
    key = prefix_key(prompt, block_size, max_blocks)
    if len(prompt) < block_size:
        assert key is None  # a partial block is never cached: nothing to meet over
        return
    n = min(len(prompt) // block_size, max_blocks) * block_size
    if n < max_blocks * block_size:
        tail = tail[: block_size - 1]  # a partial block only: more full blocks would join the key
    assert prefix_key(prompt[:n] + tail, block_size, max_blocks) == key
    changed = list(prompt)
    changed[n - 1] += 1
    assert prefix_key(changed, block_size, max_blocks) != key
    assert prefix_key(prompt, block_size, max_blocks, salt="tenant-a") != key


@given(st.binary(min_size=1, max_size=16), names_st, st.randoms())
def test_rendezvous_rank_is_a_permutation_independent_of_order(key, names, rnd):
    ranked = rendezvous_rank(key, names)
    assert sorted(ranked) == sorted(names)
    shuffled = list(names)
    rnd.shuffle(shuffled)
    assert rendezvous_rank(key, shuffled) == ranked


@given(st.binary(min_size=1, max_size=16), names_st, st.data())
def test_a_replica_leaving_moves_only_its_own_keys(key, names, data):
    gone = data.draw(st.sampled_from(names))
    ranked = rendezvous_rank(key, names)
    rest = [n for n in names if n != gone]
    if rest:
        assert rendezvous_rank(key, rest) == [n for n in ranked if n != gone]


def test_keys_spread_evenly_over_replicas():
    counts = {"10.0.0.1:50061": 0, "10.0.0.2:50061": 0, "10.0.0.3:50061": 0}
    for i in range(3000):
        key = prefix_key(list(range(i, i + 16)), 16, 4)
        counts[rendezvous_rank(key, list(counts))[0]] += 1
    assert all(800 <= c <= 1200 for c in counts.values()), counts


loads_st = st.lists(
    st.builds(
        ReplicaLoad,
        name=st.text("abcxyz", min_size=1, max_size=6),
        inflight=st.integers(0, 64),
        running=st.integers(0, 64),
        waiting=st.integers(0, 64),
        kv_usage=st.floats(0.0, 1.0),
    ),
    min_size=1,
    max_size=5,
    unique_by=lambda r: r.name,
)


@settings(max_examples=300)
@given(st.one_of(st.none(), st.binary(min_size=1, max_size=16)), loads_st)
def test_the_choice_is_never_overloaded_and_prefers_the_key_owner(key, loads):
    choice = choose_replica(key, loads, POLICY)
    by_name = {r.name: r for r in loads}
    least = min(loads, key=lambda r: r.score(POLICY))
    assert not is_overloaded(by_name[choice.name], least, POLICY)
    if key is None:
        assert choice.reason == LEAST_LOADED
        assert by_name[choice.name].score(POLICY) == least.score(POLICY)
        return
    ranked = rendezvous_rank(key, list(by_name))
    first_fit = next(n for n in ranked if not is_overloaded(by_name[n], least, POLICY))
    assert choice.name == first_fit
    assert choice.reason == (AFFINITY if first_fit == ranked[0] else OVERFLOW)


def _owner_and_other(key: bytes) -> tuple[str, str]:
    first, second = rendezvous_rank(key, ["a", "b"])
    return first, second


@pytest.mark.parametrize(
    "owner_load, other_load, expected",
    [
        # (inflight, running, waiting, kv_usage) of the key's owner and of the other replica
        ((0, 0, 0, 0.0), (0, 0, 0, 0.0), AFFINITY),  # idle: affinity
        ((4, 0, 0, 0.0), (0, 0, 0, 0.0), AFFINITY),  # 4 more is within balance_abs
        ((5, 0, 0, 0.0), (0, 0, 0, 0.0), OVERFLOW),  # 5 more, and more than 1.5x of 0
        ((16, 0, 0, 0.0), (11, 0, 0, 0.0), AFFINITY),  # 5 more but under 1.5x
        ((12, 0, 0, 0.0), (6, 0, 0, 0.0), OVERFLOW),  # 6 more and 2x
        ((1, 10, 6, 0.0), (1, 0, 0, 0.0), OVERFLOW),  # another gateway loads it (heartbeat figures)
        ((2, 0, 0, 1.0), (0, 0, 0, 0.0), OVERFLOW),  # a full KV pool counts as 4 queued requests
        ((2, 0, 0, 0.5), (0, 0, 0, 0.0), AFFINITY),
    ],
)
def test_load_overrules_affinity_beyond_both_margins(owner_load, other_load, expected):
    key = prefix_key(list(range(64)), 16, 4)
    owner, other = _owner_and_other(key)
    loads = [
        ReplicaLoad(owner, *owner_load[:3], kv_usage=owner_load[3]),
        ReplicaLoad(other, *other_load[:3], kv_usage=other_load[3]),
    ]
    choice = choose_replica(key, loads, POLICY)
    assert choice.reason == expected
    assert choice.name == (owner if expected == AFFINITY else other)


def test_short_prompts_go_to_the_least_loaded():
    loads = [ReplicaLoad("a", inflight=3), ReplicaLoad("b", inflight=1), ReplicaLoad("c", inflight=2)]
    assert choose_replica(prefix_key([1, 2, 3], 16, 4), loads, POLICY) == ("b", LEAST_LOADED)


def test_equally_loaded_replicas_share_light_traffic():
    loads = [ReplicaLoad("a"), ReplicaLoad("b")]
    picks = [choose_replica(None, loads, POLICY, tiebreak=f"req-{i}".encode()).name for i in range(200)]
    assert 70 <= picks.count("a") <= 130


def test_no_replica_is_an_error():
    with pytest.raises(ValueError):
        choose_replica(b"k", [], POLICY)


def test_round_robin_takes_turns():
    rr = RoundRobin()
    loads = [ReplicaLoad("b"), ReplicaLoad("a")]
    assert [rr.choose(loads).name for _ in range(4)] == ["a", "b", "a", "b"]
