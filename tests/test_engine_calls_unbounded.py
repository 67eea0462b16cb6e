"""Submit, Abort and SetPaused have no fixed deadline on either side of engine.v1: they wait for the
step in progress however long it rightly takes, and end only when the watchdog says the engine is
hung, the caller leaves, or the session is lost. (Before, both sides gave up after 30 s, so a long
prompt's chunk on a slow machine turned into a 503.)"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_svc.server.engine_loop import CallAbandoned, EngineLoop
from gateway.engine_client import EngineClient, EngineUnavailable
from llmserve_proto.engine.v1 import engine_pb2 as pb


def _call_in_thread(loop: EngineLoop, fn, give_up):
    box = {}

    def run():
        try:
            box["result"] = loop.call(fn, give_up)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_a_call_waits_for_the_loop_past_many_heartbeats_and_gets_its_answer():
    loop = EngineLoop(engine=None, heartbeat_s=0.001)
    asked = threading.Semaphore(0)

    def give_up():
        asked.release()
        return None  # not stalled, the caller still there: keep waiting

    t, box = _call_in_thread(loop, lambda: 42, give_up)
    for _ in range(50):  # the loop is "inside a step" for 50 heartbeats: the call keeps waiting
        asked.acquire()
    loop._drain_commands(block_s=0.0)  # the step ends; the loop takes its commands
    t.join()
    assert box == {"result": 42}


def test_a_call_stops_waiting_when_told_why():
    loop = EngineLoop(engine=None, heartbeat_s=0.001)
    reasons = iter([None, None, "the engine is stalled (watchdog)"])
    t, box = _call_in_thread(loop, lambda: 42, lambda: next(reasons))
    t.join()
    assert isinstance(box["error"], CallAbandoned) and "stalled" in str(box["error"])


class _NeverAnswers:
    """An engine stub whose unary calls land only when the test says so."""

    def __init__(self):
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.calls = []

    def _unary(self, name):
        async def call(msg, timeout=None):
            self.calls.append((name, timeout))
            self.started.set()
            await self.release.wait()
            return None

        return call

    def __getattr__(self, name):
        return self._unary(name)


def _client_with(stub) -> EngineClient:
    client = EngineClient("unix:///nonexistent", use_shared_memory=False)
    client._stub = stub
    client._session_id = "s"
    client._ready.set()
    return client


def test_a_lost_session_ends_a_pending_submit_abort_and_set_paused():
    async def main():
        stub = _NeverAnswers()
        client = _client_with(stub)
        submit = asyncio.ensure_future(client.submit("r1", [1, 2, 3], pb.SamplingParams(max_tokens=4)))
        abort = asyncio.ensure_future(client.abort(["r0"]))
        pause = asyncio.ensure_future(client.set_paused(["r2"], True))
        while len(stub.calls) < 3:
            await stub.started.wait()
            await asyncio.sleep(0)
        assert all(timeout is None for _, timeout in stub.calls), stub.calls  # no fixed deadline
        assert not (submit.done() or abort.done() or pause.done())
        client._lost("the engine is unavailable (hung)")
        with pytest.raises(EngineUnavailable):
            await submit
        await abort  # the session's requests ended with it: nothing to report
        await pause
        assert "r1" not in client._handles

    asyncio.run(main())


def test_a_client_leaving_mid_submit_still_aborts_it_once_it_lands():
    async def main():
        stub = _NeverAnswers()
        client = _client_with(stub)
        submit = asyncio.ensure_future(client.submit("r1", [1, 2, 3], pb.SamplingParams(max_tokens=4)))
        await stub.started.wait()
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        assert [name for name, _ in stub.calls] == ["Submit"]
        stub.release.set()  # the Submit lands: the request is aborted, not left running for nobody
        while [name for name, _ in stub.calls] != ["Submit", "Abort"]:
            await asyncio.sleep(0)

    asyncio.run(main())
