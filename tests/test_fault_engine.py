"""The engine hangs, dies, raises or stalls under open streams, and the gateway dies under the engine:
real processes, real signals. Every stream ends (no hang), with UNAVAILABLE and the cause the
gateway names; service comes back where the fault allows; and nothing is left: pool whole, no
request, no shared-memory segment.

Each test waits for the events it means, never for a wall-clock figure (the machine may be busy): an
injected fault is armed once the streams are open (``FaultTrigger``), a stall ends when the test says
so after it has seen its effect, and which mechanism ended the streams is read from their status, not
from how fast they ended. ``HANG_S`` bounds only what would otherwise hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.client import LLMServeClient
from tests.fault_helpers import (
    FaultTrigger,
    OpenStreams,
    alive,
    assert_engine_clean,
    assert_no_segments_of,
    assert_segments_only_of_live_sessions,
    engine_pid,
    loss_reasons,
    stop_and_check,
    wait_for,
)
from tests.service_process import ServiceProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = dict(max_tokens=1000, ignore_eos=True, temperature=0.0)
# What would otherwise hang: far above any step or detection time, below the clients' 60 s deadline
# (a stream that ran into that deadline would end DEADLINE_EXCEEDED, not UNAVAILABLE).
HANG_S = 45.0


def _health(client: LLMServeClient, status: int, within_s: float = HANG_S) -> None:
    wait_for(lambda: client.health_status() == status, within_s, f"health {status}")


def _all_unavailable(streams: OpenStreams) -> None:
    assert streams.codes() == [grpc.StatusCode.UNAVAILABLE] * len(streams.calls), streams.results


@pytest.fixture(scope="module")
def svc(tiny_llama):
    sp = ServiceProcess(
        tiny_llama,
        "--transport",
        "shm",
        "--num-kv-blocks",
        "256",
        "--engine-heartbeat-timeout",
        "3.0",  # a frozen engine is given up on after 3 s (a busy machine's engine answers within it)
        "--engine-restarts",
        "1",
        "--tokenizer-workers",
        "1",
    ).start()
    try:
        yield sp
        stop_and_check(sp)
    finally:
        sp.kill()


def test_engine_sigstop_ends_streams_then_sigcont_restores_service(svc):
    pid = engine_pid(svc)
    with LLMServeClient(svc.target, timeout=60) as client:
        streams = OpenStreams(client, [f"hang {i}" for i in range(3)], **LONG)
        os.kill(pid, signal.SIGSTOP)
        try:
            streams.join(HANG_S)
            _all_unavailable(streams)
            # The missing heartbeats ended them (not the client's deadline, nor a watchdog).
            assert loss_reasons(streams) == ["heartbeat_timeout"] * 3, streams.results
            _health(client, NOT_SERVING)
            with pytest.raises(grpc.RpcError) as e:
                client.generate("while frozen", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            os.kill(pid, signal.SIGCONT)
        _health(client, SERVING)  # the same engine, the same gateway: a new session
        assert engine_pid(svc) == pid
        out = client.generate("after the thaw", max_tokens=4, ignore_eos=True)
        assert out.usage.completion_tokens == 4
    assert_engine_clean(svc)  # the frozen session's requests were aborted once the engine woke
    assert_segments_only_of_live_sessions(svc)


def test_engine_sigkill_ends_streams_and_the_launcher_restarts_it(svc):
    old = engine_pid(svc)
    with LLMServeClient(svc.target, timeout=60) as client:
        streams = OpenStreams(client, [f"doomed {i}" for i in range(3)], **LONG)
        os.kill(old, signal.SIGKILL)
        streams.join(HANG_S)
        _all_unavailable(streams)
        _health(client, NOT_SERVING)
        _health(client, SERVING, 90.0)
        new = engine_pid(svc)
        assert new != old and alive(new) and not alive(old)
        out = client.generate("after the restart", max_tokens=4, ignore_eos=True)
        assert out.usage.completion_tokens == 4
    assert_engine_clean(svc)
    assert_no_segments_of([old])  # the killed engine's rings: swept by the new engine at its start
    assert_segments_only_of_live_sessions(svc)


def test_gateway_sigkill_makes_the_engine_abort_everything_and_exit(tiny_llama):
    sp = ServiceProcess(
        tiny_llama, "--transport", "shm", "--num-kv-blocks", "128", "--tokenizer-workers", "1"
    ).start()
    try:
        children = sp.descendants()
        pid = engine_pid(sp)
        with LLMServeClient(sp.target, timeout=60) as client:
            streams = OpenStreams(client, [f"orphan {i}" for i in range(2)], **LONG)
            os.kill(sp.pid, signal.SIGKILL)
            streams.join(HANG_S)
            assert streams.codes() == [grpc.StatusCode.UNAVAILABLE] * 2
        sp.proc.wait(5)
        wait_for(lambda: not any(alive(p) for p in children), HANG_S, "engine/tokenizer outlived the gateway")
        assert_no_segments_of([pid, sp.pid])
    finally:
        sp.kill()


def test_forward_pass_that_raises_ends_every_stream_and_nothing_hangs(tiny_llama, tmp_path):
    """The first forward pass after all four streams run raises: the engine's loop fails, it closes
    its sessions and exits; every stream ends UNAVAILABLE because the engine went (closed, or the
    connection broke: not a heartbeat timeout or a watchdog), and the gateway serves no more."""
    fault = FaultTrigger(tmp_path)
    sp = ServiceProcess(
        tiny_llama,
        "--transport",
        "shm",
        "--num-kv-blocks",
        "128",
        "--tokenizer-workers",
        "1",
        env=fault.env(raise_at=1),
    ).start()
    try:
        pid = engine_pid(sp)
        with LLMServeClient(sp.target, timeout=60) as client:
            streams = OpenStreams(client, [f"faulty {i}" for i in range(4)], **LONG)
            fault.arm()
            streams.join(HANG_S)
            _all_unavailable(streams)
            assert set(loss_reasons(streams)) <= {"closed", "error"}, streams.results
            wait_for(lambda: not alive(pid), HANG_S, "the failed engine did not exit")
            _health(client, NOT_SERVING)
            with pytest.raises(grpc.RpcError) as e:
                client.generate("anyone?", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "injected fault in forward pass 1" in sp.log_tail(20000)
        assert_no_segments_of([pid])  # the engine closed its sessions on the way out
        stop_and_check(sp)
    finally:
        sp.kill()


def test_engine_watchdog_ends_streams_on_a_stalled_step_and_service_resumes(tiny_llama, tmp_path):
    """A forward pass stalls (until the test ends it) once three streams run: a watchdog (1 s)
    ends the streams while the step is still stuck, health says NOT_SERVING; once the step
    completes the same engine serves again."""
    fault = FaultTrigger(tmp_path)
    sp = ServiceProcess(
        tiny_llama,
        "--transport",
        "shm",
        "--num-kv-blocks",
        "128",
        "--tokenizer-workers",
        "1",
        "--watchdog-timeout",
        "1.0",
        env=fault.env(stall_at=1),
    ).start()
    try:
        pid = engine_pid(sp)
        with LLMServeClient(sp.target, timeout=60) as client:
            streams = OpenStreams(client, [f"stalled {i}" for i in range(3)], **LONG)
            fault.arm()
            streams.join(HANG_S)  # the step is still stuck: only a watchdog can have ended them
            _all_unavailable(streams)
            # The engine's watchdog ends its sessions (closed); the gateway's, on the same 1 s, may
            # give up on the session first (hung). Never the heartbeat: the engine's gRPC is fine.
            assert set(loss_reasons(streams)) <= {"closed", "hung"}, streams.results
            _health(client, NOT_SERVING)
            wait_for(lambda: "no engine step completed for" in sp.log_tail(40000), HANG_S, "no watchdog log")
            fault.end_stall()
            _health(client, SERVING)  # the step completes: the same engine serves again
            assert engine_pid(sp) == pid and alive(pid)
            out = client.generate("after the stall", max_tokens=4, ignore_eos=True)
            assert out.usage.completion_tokens == 4
        log = sp.log_tail(40000)
        assert "no engine step completed for" in log and "makes progress again" in log
        assert_engine_clean(sp)
        assert_segments_only_of_live_sessions(sp)
        stop_and_check(sp)
    finally:
        sp.kill()


def test_gateway_watchdog_notices_a_hung_engine_whose_own_watchdog_is_off(tiny_llama, tmp_path):
    """The engine's heartbeats go on (its gRPC threads are fine) while its loop is stuck; the gateway
    sees the step counter stand still with work pending and gives up on the session (hung)."""
    fault = FaultTrigger(tmp_path)
    sock = tmp_path / "engine.sock"
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine_svc.server",
            "--model",
            str(tiny_llama),
            "--socket",
            str(sock),
            "--num-kv-blocks",
            "128",
            "--watchdog-timeout",
            "0",
        ],
        env={**os.environ, **fault.env(stall_at=1)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        sp = ServiceProcess(
            tiny_llama,
            "--transport",
            "shm",
            "--engine",
            f"unix://{sock}",
            "--tokenizer-workers",
            "0",
            "--watchdog-timeout",
            "1.5",
        ).start()
        try:
            with LLMServeClient(sp.target, timeout=60) as client:
                streams = OpenStreams(client, [f"hung {i}" for i in range(2)], **LONG)
                fault.arm()
                streams.join(HANG_S)  # the step is still stuck: only the gateway's watchdog can end them
                _all_unavailable(streams)
                assert loss_reasons(streams) == ["hung"] * 2, streams.results
                _health(client, NOT_SERVING)
                fault.end_stall()
                _health(client, SERVING)
                assert client.generate("unstuck", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
            assert "lost the engine" in sp.log_tail(40000) and "(hung)" in sp.log_tail(40000)
            assert_engine_clean(sp)
            stop_and_check(sp)
        finally:
            sp.kill()
    finally:
        engine.terminate()
        assert engine.wait(30) == 0
