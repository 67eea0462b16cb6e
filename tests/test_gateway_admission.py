"""Admission control alone: limits, hand-over of slots, refusal at once, cancellation while queued."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.admission import Admission
from gateway.errors import RequestError


def test_slots_queue_and_refusal():
    async def scenario():
        adm = Admission(max_concurrent=2, max_queue=1)
        release = asyncio.Event()
        order = []

        async def job(i):
            async with adm.slot():
                order.append(i)
                await release.wait()

        tasks = [asyncio.create_task(job(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert adm.running == 2 and adm.waiting == 1 and order == [0, 1]
        with pytest.raises(RequestError) as e:
            async with adm.slot():
                pass
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2] and adm.running == 0 and adm.waiting == 0

    asyncio.run(scenario())


def test_a_cancelled_waiter_gives_up_its_place():
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=2)
        release = asyncio.Event()

        async def hold():
            async with adm.slot():
                await release.wait()

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold())
        await asyncio.sleep(0.01)
        assert adm.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.waiting == 0
        release.set()
        await holder
        assert adm.running == 0

    asyncio.run(scenario())


def test_a_waiter_cancelled_just_before_a_slot_frees_leaves_the_books_straight():
    # task.cancel() cancels the awaited future at once but the task runs its handler later; a slot
    # freed in between pops that cancelled future from the queue before the handler looks for it.
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=4)
        holder = adm.slot()
        await holder.__aenter__()

        async def waiter():
            async with adm.slot():
                pass

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        assert adm.waiting == 1
        task.cancel()
        await holder.__aexit__(None, None, None)  # pops the cancelled future: nobody to hand over to
        with pytest.raises(asyncio.CancelledError):
            await task
        assert adm.running == 0 and adm.waiting == 0
        async with adm.slot():  # the slot is free for the next one
            assert adm.running == 1

    asyncio.run(scenario())


def test_the_last_slots_are_kept_for_clients_that_hold_none():
    """One client's burst takes max - new_client_slots slots and queues; a new client gets a kept
    slot at once, ahead of the burst's queue; a refusal names the limits."""

    async def scenario():
        adm = Admission(max_concurrent=4, max_queue=2, new_client_slots=1)
        release = asyncio.Event()
        admitted = []

        async def job(client, tag):
            async with adm.slot(client):
                admitted.append(tag)
                await release.wait()

        burst = [asyncio.create_task(job("burst", i)) for i in range(5)]
        await asyncio.sleep(0.01)
        assert admitted == [0, 1, 2] and adm.running == 3 and adm.waiting == 2
        with pytest.raises(RequestError) as e:  # the queue is full: refused, naming every limit
            async with adm.slot("burst"):
                pass
        for name in ("max_concurrent_requests=4", "new_client_slots=1", "max_queue_length=2"):
            assert name in e.value.message
        newcomer = asyncio.create_task(job("new", "new"))
        await asyncio.sleep(0.01)
        assert admitted[-1] == "new" and adm.running == 4 and adm.held_by("new") == 1
        release.set()
        await asyncio.gather(*burst, newcomer)
        assert sorted(map(str, admitted)) == ["0", "1", "2", "3", "4", "new"]
        assert adm.running == 0 and adm.waiting == 0 and adm.held_by("burst") == 0

    asyncio.run(scenario())


def test_a_paused_request_gives_its_slot_to_a_waiter_and_takes_one_back_on_resume():
    async def scenario():
        adm = Admission(max_concurrent=1, max_queue=1)
        release = asyncio.Event()
        got = asyncio.Event()
        holder_cm = adm.slot("a")
        slot = await holder_cm.__aenter__()

        async def waiter():
            async with adm.slot("b"):
                got.set()
                await release.wait()

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        assert adm.waiting == 1 and not got.is_set()
        slot.set_paused(True)  # its client stopped reading: the slot is handed on
        await asyncio.wait_for(got.wait(), 1)
        assert adm.running == 1 and adm.waiting == 0
        slot.set_paused(True)  # a second pause changes nothing
        assert adm.running == 1
        slot.set_paused(False)  # resumed: it runs again, past the limit (it is in the engine already)
        assert adm.running == 2
        slot.set_paused(True)
        await holder_cm.__aexit__(None, None, None)  # ends while paused: it held nothing to give back
        assert adm.running == 1
        release.set()
        await task
        assert adm.running == 0 and adm.held_by("a") == adm.held_by("b") == 0

    asyncio.run(scenario())
