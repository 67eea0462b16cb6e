"""Backpressure against clients that never read their streams (issue 17), through a real service.

Before the fix the engine kept generating for such streams, the gateway buffered their output
without bound (about 0.55 MB/s for 16 of them), and they held their admission slots until the
client went away, so a normal request got DEADLINE_EXCEEDED. Now each stream's unsent output is
bounded; a full buffer pauses the request in the engine (no steps), and after
--stream-stall-timeout without reading the request is aborted with RESOURCE_EXHAUSTED and its slot
is free again.

CI runs a scaled-down shape (8 stalled streams of 900 tokens with logprobs=20, a 4 s stall timeout,
one spare admission slot for normal traffic). The issue's full size, on the default limits
(256 slots, 30 s stall timeout; the model must allow 3,000 tokens, e.g. models/default):

    LLMSERVE_SLOW_READERS=300 LLMSERVE_SLOW_READER_TOKENS=3000 LLMSERVE_SLOW_READER_MODEL=models/default \\
        .venv/bin/python -m pytest -s tests/test_fault_slow_readers.py
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from gateway.client import LLMServeClient, build_request
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.fault_helpers import assert_engine_clean, memory_bytes, stop_and_check, wait_for
from tests.service_process import ServiceProcess

READERS = int(os.environ.get("LLMSERVE_SLOW_READERS", "8"))
TOKENS = int(os.environ.get("LLMSERVE_SLOW_READER_TOKENS", "900"))
FULL_SIZE = "LLMSERVE_SLOW_READERS" in os.environ
STALL_S = 30.0 if FULL_SIZE else 4.0
MAX_CONCURRENT = 256 if FULL_SIZE else READERS + 1  # CI: one slot left for normal traffic


@pytest.fixture(scope="module")
def svc(tiny_llama):
    model = os.environ.get("LLMSERVE_SLOW_READER_MODEL", str(tiny_llama))
    # At full size the pool holds every stalled stream's blocks (256 x 16 blocks): with fewer, some are
    # preempted before their buffers fill and wait for blocks that paused streams hold.
    args = ["--num-kv-blocks", "4096" if FULL_SIZE else "1024", "--tokenizer-workers", "1"]
    if not FULL_SIZE:
        args += [
            "--max-concurrent",
            str(MAX_CONCURRENT),
            "--max-queue",
            "0",
            "--stream-stall-timeout",
            str(STALL_S),
        ]
    sp = ServiceProcess(model, *args).start()
    try:
        yield sp
        stop_and_check(sp)
    finally:
        sp.kill()


def rss_mib(pid: int) -> float:
    return memory_bytes(pid)["rss"] / 2**20


def test_never_reading_streams_are_paused_then_aborted_and_normal_traffic_goes_on(svc):
    gw = svc.pid
    with LLMServeClient(svc.target, timeout=60) as client:
        client.generate("warm up", max_tokens=4)
        rss = {"before": rss_mib(gw)}
        # A client that never reads, with small flow-control windows (1 KiB a stream, no BDP growth)
        # so that gRPC stops taking the gateway's messages after a few: a default client's 64 KiB
        # and more only make the buffers fill later (after some 300 steps at logprobs=20).
        stalled_channel = grpc.insecure_channel(
            svc.target, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        )
        stub = gen_grpc.GenerationStub(stalled_channel)
        calls = [
            stub.GenerateStream(
                build_request(f"never read {i}", max_tokens=TOKENS, ignore_eos=True, logprobs=20), timeout=600
            )
            for i in range(READERS)
        ]
        admitted = min(READERS, MAX_CONCURRENT)
        started = time.monotonic()
        wait_for(
            lambda: svc.engine_stats().load.num_paused >= admitted, 300, "the stalled streams were not paused"
        )
        paused_after = time.monotonic() - started
        rss["paused"] = rss_mib(gw)

        # Once their buffers are full, the stalled streams cost the engine no steps at all.
        steps = svc.engine_stats().load.num_steps
        time.sleep(1.5)
        assert svc.engine_stats().load.num_steps == steps, "the engine stepped paused requests"

        # Normal traffic beside them: a 16-token request completes within seconds (at full size
        # every slot is taken by a stalled stream, so as in the issue it comes after the stall
        # timeout has aborted the first of them).
        if FULL_SIZE:
            wait_for(lambda: svc.engine_stats().num_live_requests < admitted, STALL_S + 60, "no stall abort")
        t0 = time.monotonic()
        out = client.generate("a normal request", max_tokens=16, ignore_eos=True, timeout=30)
        normal_s = time.monotonic() - t0
        assert out.usage.completion_tokens == 16 and normal_s < 5, normal_s
        rss["during"] = rss_mib(gw)

        def all_live_paused():
            st = svc.engine_stats()
            return st.load.num_paused == st.num_live_requests

        wait_for(all_live_paused, 120, "the stalled streams admitted later were not paused")
        steps = svc.engine_stats().load.num_steps
        time.sleep(1.0)
        assert svc.engine_stats().load.num_steps == steps

        # After the stall timeout the stalled requests are aborted and give back their slots.
        wait_for(
            lambda: svc.engine_stats().num_live_requests == 0, STALL_S + 30, "stalled requests not aborted"
        )
        aborted_after = time.monotonic() - started
        results: dict[int, object] = {}

        def normal(i: int) -> None:
            try:
                results[i] = client.generate(f"after {i}", max_tokens=8, ignore_eos=True, timeout=60)
            except grpc.RpcError as e:
                results[i] = e

        threads = [
            threading.Thread(target=normal, args=(i,)) for i in range(MAX_CONCURRENT if not FULL_SIZE else 16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        errors = [r for r in results.values() if isinstance(r, grpc.RpcError)]
        assert not errors, [(e.code(), e.details()) for e in errors]  # every slot was free again

        # The stalled client, reading at last, gets what gRPC had buffered, then a clear status.
        with pytest.raises(grpc.RpcError) as e:
            for _ in calls[0]:
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream_stall_timeout_s" in e.value.details()
        stalled_channel.close()
        time.sleep(1.0)
        rss["after"] = rss_mib(gw)
    print(
        f"\n{READERS} never-reading streams of {TOKENS} tokens (logprobs=20): all paused after "
        f"{paused_after:.1f}s, aborted after {aborted_after:.1f}s (stall timeout {STALL_S:g}s); a normal "
        f"16-token request beside them took {normal_s * 1000:.0f} ms; gateway RSS before "
        f"{rss['before']:.0f}, paused {rss['paused']:.0f}, during {rss['during']:.0f}, "
        f"after {rss['after']:.0f} MiB"
    )
    assert rss["during"] - rss["before"] < 64 + 0.5 * READERS, rss
    assert_engine_clean(svc)
