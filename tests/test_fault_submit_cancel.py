"""A client that leaves while its request is being submitted to the engine (a real engine process,
the gateway's EngineClient in this one): nothing may be left behind — no handle in the gateway, no
request running for nobody in the engine, no prompt-ring span that is never released (the ring
releases in order, so one such span would pin it for good)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from engine_svc.rpc.convert import sampling_params_to_proto
from engine_svc.sampling_params import SamplingParams
from gateway.engine_client import EngineClient
from llmserve_proto.engine.v1 import engine_pb2


@pytest.fixture
def engine_socket(tiny_llama, tmp_path):
    sock = tmp_path / "engine.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_svc.server", "--model", str(tiny_llama), "--socket", str(sock)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_cancel_mid_submit_aborts_the_request_and_releases_its_prompt_span(engine_socket):
    async def main() -> tuple[engine_pb2.EngineStats, int, int, int]:
        client = EngineClient(engine_socket, use_shared_memory=True)
        await client.start()
        try:
            await client.wait_ready(120)
            assert client.transport == "shared-memory"
            params = sampling_params_to_proto(SamplingParams(max_tokens=1000, ignore_eos=True))
            cancelled = 0
            for i in range(40):
                task = asyncio.ensure_future(client.submit(f"r{i}", list(range(5, 45)), params))
                for _ in range(i % 4):  # cancel at different points of the Submit call
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    cancelled += 1
                else:
                    client.release(f"r{i}")
                    await client.abort([f"r{i}"])
            for _ in range(1200):  # until the background aborts land (the bound: a hang)
                st = await client.stats()
                if st.num_live_requests == 0 and not client._handles and not client._background:
                    break
                await asyncio.sleep(0.05)
            ring = client._prompt_ring
            return st, cancelled, ring.written, ring.released
        finally:
            await client.close()

    stats, cancelled, written, released = asyncio.run(main())
    assert cancelled >= 20  # most were cancelled mid-Submit, not after it
    assert stats.num_live_requests == 0 and stats.load.num_running == 0 and stats.load.num_waiting == 0
    assert stats.load.kv_blocks_used == 0
    assert written == released >= 20 * 40  # every prompt span written was consumed and released
