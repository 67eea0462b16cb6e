"""Load faults on a real service: a cancel storm, an overload burst, and KV-cache exhaustion."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from gateway.client import LLMServeClient, build_request
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.fault_helpers import (
    assert_engine_clean,
    assert_segments_only_of_live_sessions,
    metrics_port,
    stop_and_check,
    stream_all,
    token_ids_of,
)
from tests.service_process import ServiceProcess
from tests.test_metrics import scrape


def _service(model, *args) -> ServiceProcess:
    return ServiceProcess(model, "--tokenizer-workers", "1", "--metrics-port", "0", *args).start()


async def _cancel_storm(target: str, requests: list, delays: list[float | None]) -> list:
    """Start every stream at once; cancel each after its delay (None: once its first message came,
    so surely while it decodes). Returns how each ended."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gen_grpc.GenerationStub(ch)

        async def one(req, delay):
            call = stub.GenerateStream(req, timeout=60)
            got = 0
            first = asyncio.Event()

            async def read():
                nonlocal got
                async for _ in call:
                    got += 1
                    first.set()

            reader = asyncio.ensure_future(read())
            if delay is None:
                waiter = asyncio.ensure_future(first.wait())
                await asyncio.wait([reader, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            else:
                await asyncio.sleep(delay)
            call.cancel()
            try:
                await reader
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                pass
            return got, call.done()

        return await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays, strict=True)))


def test_cancel_storm_of_100_streams_leaves_nothing_behind(tiny_llama):
    sp = _service(
        tiny_llama,
        "--num-kv-blocks",
        "512",
        "--max-concurrent",
        "24",
        "--max-queue",
        "200",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "64",
    )
    try:
        rng = random.Random(7)
        requests, delays = [], []
        for i in range(100):
            if i % 4 == 0:  # a long prompt: prefilled in 64-token chunks, cancelled mid-prefill
                req = build_request(token_ids=[rng.randrange(3, 1000) for _ in range(700)], max_tokens=200)
            else:
                req = build_request(f"storm {i} " * rng.randint(1, 20), max_tokens=300, ignore_eos=True)
            requests.append(req)
            # early: while queued for admission or tokenizing; later: mid-prefill or decoding
            if i % 5 == 0:
                delays.append(rng.uniform(0.005, 0.05))
            elif i % 5 == 1:
                delays.append(None)  # after its first token: decoding
            else:
                delays.append(rng.uniform(0.0, 0.6))
        results = asyncio.run(_cancel_storm(sp.target, requests, delays))
        assert all(done for _, done in results)
        assert_engine_clean(sp, within_s=60.0)  # the aborts land (the bound: a hang)
        s = scrape(metrics_port(sp))
        outcomes = {k: v for k, v in s.items() if k.startswith("llmserve_requests_total")}
        # A stream cancelled before its call reached the server leaves no trace there at all; one
        # whose cancel came after its last token finished normally.
        allowed = {f"llmserve_requests_total{{outcome={o}}}" for o in ("cancelled", "stop", "length")}
        assert set(outcomes) <= allowed, outcomes
        cancelled = outcomes["llmserve_requests_total{outcome=cancelled}"]
        finished = sum(v for k, v in outcomes.items() if not k.endswith("{outcome=cancelled}"))
        # The gateway's view: the 20 cancelled once their first token came were cancelled while
        # decoding; others before their first token (queued, tokenizing or prefilling). How many of
        # the early cancels reached the server at all depends on the machine's speed (a busy one
        # sees fewer), so only that both kinds happened is asserted.
        started = s["llmserve_time_to_first_token_seconds_count"]
        print(f"\ncancel storm: {cancelled:g} cancelled on the server, {started:g} after their first token")
        assert started >= 20 and cancelled >= 20, (started, cancelled)
        assert cancelled - (started - finished) >= 1, (started, cancelled, finished)  # before a first token
        assert s["llmserve_gateway_requests_in_flight"] == 0
        with LLMServeClient(sp.target, timeout=30) as client:  # and it still serves
            assert (
                client.generate("after the storm", max_tokens=5, ignore_eos=True).usage.completion_tokens == 5
            )
        assert_engine_clean(sp)
        assert_segments_only_of_live_sessions(sp)
        stop_and_check(sp)
    finally:
        sp.kill()


def test_overload_burst_of_200_against_8_running_and_16_queued(tiny_llama):
    sp = _service(tiny_llama, "--num-kv-blocks", "256", "--max-concurrent", "8", "--max-queue", "16")
    try:
        requests = [build_request(f"burst {i}", max_tokens=128, ignore_eos=True) for i in range(200)]
        results = asyncio.run(stream_all(sp.target, requests))  # a hang ends DEADLINE_EXCEEDED
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        done = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        # One channel is one client: it gets 7 of the 8 slots (one is kept for new clients) and 16 queued.
        assert len(done) >= 23 and len(refused) >= 120, (len(done), len(refused))
        for msgs in done:  # every admitted request ran to the end
            assert msgs[-1].finish_reason == gen.FINISH_REASON_LENGTH
            assert msgs[-1].usage.completion_tokens == 128
        s = scrape(metrics_port(sp))
        assert s["llmserve_requests_total{outcome=resource_exhausted}"] == len(refused)
        assert s["llmserve_requests_total{outcome=length}"] == len(done)
        assert_engine_clean(sp)
        assert_segments_only_of_live_sessions(sp)
        stop_and_check(sp)
    finally:
        sp.kill()


@pytest.fixture(scope="module")
def tiny_pool(tiny_llama):
    # 24 blocks of 16 tokens: six requests of 40 + 80 tokens (8 blocks each) cannot all fit at once.
    sp = _service(tiny_llama, "--num-kv-blocks", "24", "--block-size", "16", "--max-num-seqs", "8")
    try:
        yield sp
        stop_and_check(sp)
    finally:
        sp.kill()


def test_kv_exhaustion_preempts_and_outputs_equal_solo_runs(tiny_pool):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(6)]
    opts = dict(max_tokens=80, ignore_eos=True, temperature=0.0, return_token_ids=True)
    with LLMServeClient(tiny_pool.target, timeout=120) as client:
        solo = [list(client.generate(token_ids=p, **opts).token_ids) for p in prompts]
    before = tiny_pool.engine_stats().load.num_preemptions
    results = asyncio.run(stream_all(tiny_pool.target, [build_request(token_ids=p, **opts) for p in prompts]))
    assert tiny_pool.engine_stats().load.num_preemptions > before, "the pool never ran out"
    together = [token_ids_of(msgs) for msgs in results]
    assert together == solo
    assert_engine_clean(tiny_pool)
    assert_segments_only_of_live_sessions(tiny_pool)


def test_a_prompt_larger_than_the_whole_pool_is_refused_up_front(tiny_pool):
    with LLMServeClient(tiny_pool.target, timeout=30) as client:
        for ids, max_tokens in (([5] * 400, 1), ([5] * 300, 200)):
            with pytest.raises(grpc.RpcError) as e:
                client.generate(token_ids=ids, max_tokens=max_tokens)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "whole cache has 24 blocks" in e.value.details()
        assert client.generate("fits", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    st = tiny_pool.engine_stats()
    assert st.num_refused_submits == 0  # the gateway answered; the engine never saw them
    assert_engine_clean(tiny_pool)
