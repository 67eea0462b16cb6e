"""Admission limits, the engine dying under open streams, and a SIGTERM drain: real processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine_svc.rpc.shm_segments import creator_pid, list_segments
from gateway.client import LLMServeClient
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from tests.service_process import ServiceProcess


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _drain(call, sink: dict, key) -> None:
    try:
        sink[key] = list(call)
    except grpc.RpcError as e:
        sink[key] = e


@pytest.fixture(scope="module")
def small_service(default_model_dir):
    with ServiceProcess(
        default_model_dir,
        "--num-kv-blocks",
        "512",
        "--max-concurrent",
        "2",
        "--max-queue",
        "1",
        "--tokenizer-workers",
        "1",
    ) as sp:
        yield sp


def test_over_the_admission_limit_is_refused_at_once_and_admitted_requests_complete(small_service):
    with LLMServeClient(small_service.target, timeout=120) as client:
        # Long enough (2000 steps) that the two admitted requests are still running when the probe comes.
        calls = [client.generate_stream(f"admitted {i}", max_tokens=2000, ignore_eos=True) for i in range(2)]
        firsts = [next(iter(c)) for c in calls]  # these two run (sent together, either could be first)
        assert all(m.request_id for m in firsts)
        # Drain every stream in the background, noting when each one ends.
        results: dict = {}
        ended: dict[int, float] = {}

        def drain(i):
            try:
                results[i] = [*firsts[i : i + 1], *calls[i]]
            except grpc.RpcError as e:
                results[i] = e
            ended[i] = time.monotonic()

        # Two more, to one queue place: whichever reaches the gateway's queue second (the gateway's
        # order, which no client can see) is refused.
        calls += [client.generate_stream(f"extra {i}", max_tokens=2000, ignore_eos=True) for i in (2, 3)]
        threads = [threading.Thread(target=drain, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        refused = [i for i in (2, 3) if isinstance(results[i], grpc.RpcError)]
        assert len(refused) == 1, results
        (r,) = refused
        assert results[r].code() == grpc.StatusCode.RESOURCE_EXHAUSTED, results[r]
        # "At once": refused while both admitted requests were still generating, not queued behind them.
        assert ended[r] < min(ended[0], ended[1])
        for i in {0, 1, 2, 3} - {r}:
            assert results[i][-1].finish_reason == gen.FINISH_REASON_LENGTH
            assert results[i][-1].usage.completion_tokens == 2000


def test_engine_killed_mid_stream_ends_streams_unavailable_and_health_not_serving(small_service):
    """Runs last against this module's service: the engine does not come back."""
    with LLMServeClient(small_service.target, timeout=60) as client:
        calls = [client.generate_stream(f"doomed {i}", max_tokens=3000, ignore_eos=True) for i in range(2)]
        for c in calls:
            next(iter(c))
        results: dict = {}
        threads = [threading.Thread(target=_drain, args=(c, results, i)) for i, c in enumerate(calls)]
        for t in threads:
            t.start()
        os.kill(small_service.engine_pid, signal.SIGKILL)
        for t in threads:
            t.join(60)  # the bound: a hang
        for i in range(2):
            assert isinstance(results[i], grpc.RpcError), results[i]
            assert results[i].code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 60  # the bound: a hang
        while client.health_status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health did not turn NOT_SERVING"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:
            client.generate("anyone there?", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert small_service.proc.poll() is None  # the gateway itself stays up


def test_sigterm_drains_then_exits_clean(default_model_dir):
    sp = ServiceProcess(
        default_model_dir,
        "--num-kv-blocks",
        "512",
        "--drain-grace-s",
        "2",
        "--tokenizer-workers",
        "1",
        "--transport",
        "shm",  # the rings, and their removal on the way out
    ).start()
    try:
        children = sp.descendants()
        engine_pid = sp.engine_pid
        assert engine_pid in children and len(children) >= 2  # engine and tokenizer worker(s)
        assert any(creator_pid(n) == engine_pid for n in list_segments())  # the rings exist while serving
        with LLMServeClient(sp.target, timeout=60) as client:
            short = client.generate_stream("finishes in the grace period", max_tokens=20, ignore_eos=True)
            long = client.generate_stream("cannot finish in time", max_tokens=3000, ignore_eos=True)
            next(iter(short))
            next(iter(long))
            results: dict = {}
            threads = [
                threading.Thread(target=_drain, args=(c, results, k))
                for k, c in (("short", short), ("long", long))
            ]
            for t in threads:
                t.start()
            sp.proc.send_signal(signal.SIGTERM)
            # Draining (health says so at once) lasts the 2 s grace at least: within it,
            deadline = time.monotonic() + 60  # the bound: a hang
            while client.health_status() != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health did not turn NOT_SERVING on SIGTERM"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as e:
                client.generate("too late", max_tokens=2, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            for t in threads:
                t.join(30)
        assert results["short"][-1].finish_reason == gen.FINISH_REASON_LENGTH
        assert results["long"][-1].finish_reason == gen.FINISH_REASON_ABORT
        assert sp.proc.wait(30) == 0
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in children if _alive(p)], "child processes outlived the service"
        assert not [n for n in list_segments() if creator_pid(n) in (engine_pid, sp.pid)]
    finally:
        sp.kill()
