"""grpc.health.v1 on the engine process (real processes, real sockets): SERVING once warm, on a unix
socket, on TCP and over mTLS; NOT_SERVING while the loop is stuck in a forward pass (the fault
injection stalls one; the process itself keeps answering), SERVING again when the step returns,
and NOT_SERVING from SIGTERM on. Watch delivers each change."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.rpc.convert import sampling_params_to_proto
from engine_svc.rpc.tls import ClientTLS
from engine_svc.sampling_params import SamplingParams
from engine_svc.server.engine_loop import EngineLoop
from engine_svc.server.fault_injection import STALL_AT, STALL_UNTIL
from engine_svc.server.health import ENGINE_SERVICE, EngineHealth
from engine_svc.server.watchdog import Watchdog
from llmserve_proto.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.replica_helpers import free_port
from tests.tls_certs import make_tls_material

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCHDOG_SECONDS = 0.5


class EngineProcess:
    """``python -m engine_svc.server`` with its log in a file, for the assertion messages."""

    def __init__(self, model_dir: Path, *args: str, env: dict | None = None) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="llmserve-health-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "engine_svc.server", "--model", str(model_dir), "--num-kv-blocks", "64"]
        self.proc = subprocess.Popen(
            [*cmd, *args],
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
        )

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def terminate(self) -> int:
        self.proc.terminate()
        return self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        Path(self._log.name).unlink(missing_ok=True)


def check(channel: grpc.Channel, service: str = "") -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        .status
    )


def wait_until(predicate, within_s: float, what: str, engine: EngineProcess) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert engine.proc.poll() is None, f"the engine exited {engine.proc.returncode}:\n{engine.log_tail()}"
        assert time.monotonic() < deadline, f"{what}: not within {within_s}s\n{engine.log_tail()}"
        time.sleep(0.05)


def wait_serving(channel: grpc.Channel, engine: EngineProcess, within_s: float = 120.0) -> None:
    def serving() -> bool:
        try:
            return check(channel) == SERVING
        except grpc.RpcError:  # not listening yet: it opens its port only once warm
            return False

    wait_until(serving, within_s, "health SERVING", engine)


class Watcher:
    """Health.Watch drained on a thread: the statuses in the order they came, then how it ended."""

    def __init__(self, channel: grpc.Channel, service: str = "") -> None:
        self.statuses: list[int] = []
        self.ended: grpc.RpcError | None = None
        self._call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        try:
            for msg in self._call:
                self.statuses.append(msg.status)
        except grpc.RpcError as e:
            self.ended = e

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"Watch did not end within {timeout_s}s: {self.statuses}"

    def cancel(self) -> None:
        self._call.cancel()
        self.join(5)


def assert_engine_answers_health_and_refuses_unknown_names(channel: grpc.Channel) -> None:
    assert check(channel, "") == SERVING
    assert check(channel, ENGINE_SERVICE) == SERVING
    assert ENGINE_SERVICE == "engine.v1.Engine"
    with pytest.raises(grpc.RpcError) as e:
        check(channel, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_unix_socket_serving_then_not_serving_while_a_step_hangs_then_serving_then_shutdown(tiny_llama):
    sock = Path(tempfile.mkdtemp(prefix="llmserve-health-")) / "engine.sock"
    stall_over = sock.parent / "stall-over"
    engine = EngineProcess(
        tiny_llama,
        "--socket",
        str(sock),
        "--watchdog-timeout",
        str(WATCHDOG_SECONDS),
        # The first forward after the warm-up hangs until the test has seen what it means.
        env={STALL_AT: "1", STALL_UNTIL: str(stall_over)},
    )
    try:
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            wait_serving(ch, engine)
            assert_engine_answers_health_and_refuses_unknown_names(ch)
            watch_all, watch_engine = Watcher(ch), Watcher(ch, ENGINE_SERVICE)
            wait_until(
                lambda: watch_all.statuses and watch_engine.statuses, 60, "first Watch message", engine
            )

            # One request makes the loop step; that step hangs in the model's forward pass.
            stub = engine_pb2_grpc.EngineStub(ch)
            session = stub.Connect(engine_pb2.ConnectRequest(gateway_id="health-test"))
            session_id = next(session).connected.session_id
            params = sampling_params_to_proto(SamplingParams(max_tokens=4, ignore_eos=True))
            submit = engine_pb2.SubmitRequest(session_id=session_id, request_id="r1", params=params)
            submit.token_ids.ids.extend([5, 6, 7, 8])
            stub.Submit(submit, timeout=10)

            # The step is still stuck (until the test ends it): health changed while it hangs, not
            # when it returned, and the process answers probes though its loop is stuck (a TCP or
            # "is the port open" probe would have said healthy here).
            wait_until(lambda: check(ch) == NOT_SERVING, 60, "NOT_SERVING", engine)
            assert check(ch, ENGINE_SERVICE) == NOT_SERVING
            stall_over.touch()

            wait_until(lambda: check(ch) == SERVING, 60, "SERVING after the stall", engine)
            assert check(ch, ENGINE_SERVICE) == SERVING
            stats = stub.GetStats(engine_pb2.GetStatsRequest(check_invariants=True), timeout=10)
            assert not stats.invariant_error and stats.num_live_requests == 0, stats
            for w in (watch_all, watch_engine):
                assert w.statuses == [SERVING, NOT_SERVING, SERVING], w.statuses

            # Shutdown: watchers are told NOT_SERVING before the server goes away.
            engine.proc.send_signal(signal.SIGTERM)
            for w in (watch_all, watch_engine):
                w.join(15)
                assert w.statuses == [SERVING, NOT_SERVING, SERVING, NOT_SERVING], w.statuses
            assert engine.proc.wait(30) == 0, engine.log_tail()
        log = engine.log_tail(40000)
        assert "no engine step completed for" in log and "health: NOT_SERVING (shutting down)" in log
        assert not sock.exists()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tcp_engines(tiny_llama, tls):
    """A plaintext TCP engine (what the k8s grpc probe sees) and an mTLS one, started side by side."""
    plain_port, tls_port, health_port = free_port(), free_port(), free_port()
    plain = EngineProcess(tiny_llama, "--host", "127.0.0.1", "--port", str(plain_port))
    secure = EngineProcess(
        tiny_llama,
        "--host",
        "127.0.0.1",
        "--port",
        str(tls_port),
        "--tls-cert",
        str(tls.server.cert),
        "--tls-key",
        str(tls.server.key),
        "--tls-client-ca",
        str(tls.ca.cert_path),
        "--health-port",
        str(health_port),
    )
    secure.health_address = f"127.0.0.1:{health_port}"
    try:
        yield (f"127.0.0.1:{plain_port}", plain), (f"127.0.0.1:{tls_port}", secure)
        for e in (plain, secure):
            assert e.terminate() == 0, e.log_tail()
    finally:
        plain.close()
        secure.close()


def test_tcp_engine_serves_health_on_its_engine_port(tcp_engines):
    (address, engine), _ = tcp_engines
    with grpc.insecure_channel(address) as ch:
        wait_serving(ch, engine)
        assert_engine_answers_health_and_refuses_unknown_names(ch)
        w = Watcher(ch, ENGINE_SERVICE)
        wait_until(lambda: w.statuses, 5, "Watch's first message", engine)
        assert w.statuses == [SERVING]
        w.cancel()
        # The same port still serves engine.v1.
        info = engine_pb2_grpc.EngineStub(ch).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
        assert info.vocab_size > 0


def test_mtls_engine_serves_health_over_tls_to_a_client_with_a_certificate(tcp_engines, tls):
    _, (address, engine) = tcp_engines
    client = ClientTLS(ca=str(tls.ca.cert_path), cert=str(tls.client.cert), key=str(tls.client.key))
    with grpc.secure_channel(address, client.credentials()) as ch:
        wait_serving(ch, engine)
        assert_engine_answers_health_and_refuses_unknown_names(ch)
        w = Watcher(ch)
        wait_until(lambda: w.statuses, 5, "Watch's first message", engine)
        assert w.statuses == [SERVING]
        w.cancel()
    # mTLS is the link's only credential and it is checked in the handshake, before any service is
    # chosen: a prober without a client certificate, or in plaintext, gets no answer at all.
    no_cert = ClientTLS(ca=str(tls.ca.cert_path))
    for channel in (grpc.secure_channel(address, no_cert.credentials()), grpc.insecure_channel(address)):
        with channel, pytest.raises(grpc.RpcError) as e:
            check(channel)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_mtls_engine_answers_plaintext_probes_on_its_health_port_and_nothing_else(tcp_engines):
    # Kubernetes' grpc probe speaks plaintext only and has no client certificate.
    _, (_, engine) = tcp_engines
    with grpc.insecure_channel(engine.health_address) as ch:
        wait_serving(ch, engine)
        assert_engine_answers_health_and_refuses_unknown_names(ch)
        with pytest.raises(grpc.RpcError) as e:  # the engine's own API is not on this port
            engine_pb2_grpc.EngineStub(ch).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


# --- the pieces, without processes ----------------------------------------------------------------


class _Context:
    def set_code(self, code) -> None:
        self.code = code


def _status(health: EngineHealth, service: str = "") -> int:
    return health.servicer.Check(health_pb2.HealthCheckRequest(service=service), _Context()).status


def test_health_starts_not_serving_and_stays_not_serving_once_shutting_down():
    health = EngineHealth()
    assert _status(health) == _status(health, ENGINE_SERVICE) == NOT_SERVING
    health.set_serving(True)
    assert _status(health) == _status(health, ENGINE_SERVICE) == SERVING
    health.shutting_down()
    health.set_serving(True)  # a recovery reported during shutdown changes nothing
    assert _status(health) == _status(health, ENGINE_SERVICE) == NOT_SERVING


def _loop_with_clock(on_stall_hook=None):
    """An engine loop (never started) whose watchdog runs on a clock the test moves."""
    now = [0.0]
    loop = EngineLoop(engine=None, watchdog_timeout_s=1.0)
    reports: list[bool] = []
    loop.on_stall_change = reports.append

    def on_stall(waited: float) -> None:
        if on_stall_hook is not None:
            on_stall_hook(loop)
        loop._on_stall(waited)

    loop.watchdog = Watchdog(1.0, on_stall=on_stall, on_recover=loop._on_recover, clock=lambda: now[0])
    return loop, now, reports


def test_the_loop_reports_a_stall_and_the_recovery():
    loop, now, reports = _loop_with_clock()
    loop.watchdog.step_started()
    now[0] = 2.0
    assert loop.watchdog.check()
    assert loop.stalled.is_set() and reports == [True]
    loop.watchdog.step_finished(pending=False)
    assert not loop.stalled.is_set() and reports == [True, False]


def test_a_recovery_that_lands_before_the_stall_handler_runs_leaves_the_loop_not_stalled():
    """The watchdog trips, then the step returns on the loop thread before the watchdog's thread has
    run its handler: the last word must be 'not stalled', or health would stay NOT_SERVING (and the
    engine refuse work) though the loop is fine."""
    loop, now, reports = _loop_with_clock(on_stall_hook=lambda lp: lp.watchdog.step_finished(pending=False))
    loop.watchdog.step_started()
    now[0] = 2.0
    assert loop.watchdog.check()
    assert not loop.stalled.is_set()
    assert reports[-1] is False
