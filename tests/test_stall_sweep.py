"""StallSweeper alone: the stall timeout counted from when a client stopped reading, and shedding
the streams unread longest once more than max_paused_streams are paused."""

from __future__ import annotations

import asyncio

import grpc

from gateway.stall_sweep import StallSweeper, StreamControl


class FakeHandle:
    def __init__(self, unread_since: float | None) -> None:
        self.since = unread_since

    def unread_since(self) -> float | None:
        return self.since


class FakeContext:
    def __init__(self) -> None:
        self.status = None

    async def abort(self, code, details):
        self.status = (code, details)
        raise RuntimeError("abort() always raises")


def test_the_timeout_ends_streams_unread_past_it_and_the_excess_paused_are_shed_oldest_first():
    async def scenario():
        async def handler():
            await asyncio.sleep(3600)

        # Unread since: a 0 (stalled past 30 s at now=40), b 20, c 25, d 30, e 35, f reading.
        unread = {"a": 0.0, "b": 20.0, "c": 25.0, "d": 30.0, "e": 35.0, "f": None}
        streams = {}
        for rid, since in unread.items():
            task = asyncio.create_task(handler())
            streams[rid] = StreamControl(task, FakeContext(), rid, handle=FakeHandle(since))
        sweeper = StallSweeper(streams, timeout_s=30.0, max_paused=2)
        assert sweeper.sweep(40.0) == 3  # a by the timeout; b and c shed: 4 paused left, 2 allowed
        await asyncio.gather(*sweeper._ending)
        ended = {rid: c for rid, c in streams.items() if c.stalled}
        assert sorted(ended) == ["a", "b", "c"]
        assert ended["a"].outcome == "stalled" and "stream_stall_timeout_s=30" in ended["a"].context.status[1]
        for rid in "bc":
            code, details = ended[rid].context.status
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_paused_streams=2" in details
            assert ended[rid].outcome == "shed" and ended[rid].task.cancelled()
        assert not streams["d"].task.done() and not streams["f"].task.done()
        assert sweeper.sweep(41.0) == 0  # the ended ones are not ended twice; d and e fit
        for c in streams.values():
            c.task.cancel()
        await asyncio.gather(*(c.task for c in streams.values()), return_exceptions=True)

    asyncio.run(scenario())
