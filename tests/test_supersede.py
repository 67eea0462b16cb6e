"""supersede_key's bookkeeping (gateway/supersede.py): the newest request with a key supersedes the
one holding it, in the engine or not yet; keys are per caller; a finished request gives back only
its own claim. (End to end through the service: tests/test_fim_service.py.)"""

from __future__ import annotations

import asyncio

import pytest

from gateway.engine_client import RequestHandle
from gateway.supersede import Superseded, SupersedeKeys


def test_the_next_request_with_the_key_supersedes_the_one_in_the_engine():
    async def go():
        keys = SupersedeKeys()
        first = keys.claim("tenant:a", "editor", "r1")
        handle = RequestHandle("r1", 1)
        first.attach(handle)
        other_caller = keys.claim("tenant:b", "editor", "r9")  # another caller's key: no effect
        assert first.superseded_by is None and other_caller.superseded_by is None
        second = keys.claim("tenant:a", "editor", "r2")
        assert first.superseded_by == "r2" and second.superseded_by is None
        with pytest.raises(Superseded, match="r2"):
            await handle.next_deltas()  # the stream wakes at once with it
        keys.release("tenant:a", "editor", first)  # the superseded one ends: the key stays r2's
        keys.claim("tenant:a", "editor", "r3")
        assert second.superseded_by == "r3"

    asyncio.run(go())


def test_a_request_superseded_before_the_engine_ends_when_it_reaches_it():
    async def go():
        keys = SupersedeKeys()
        first = keys.claim("", "k", "r1")  # still tokenizing: no handle yet
        keys.claim("", "k", "r2")
        handle = RequestHandle("r1", 1)
        first.attach(handle)
        with pytest.raises(Superseded):
            await handle.next_deltas()

    asyncio.run(go())


def test_claims_are_given_back():
    keys = SupersedeKeys()
    claim = keys.claim("", "k", "r1")
    keys.release("", "k", claim)
    assert len(keys) == 0
