"""Engine replicas as real processes on localhost TCP ports, and what the routing tests read from them."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from engine_svc.rpc.shm_segments import creator_pid, list_segments
from llmserve_proto.engine.v1 import engine_pb2, engine_pb2_grpc
from tests.fault_helpers import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineReplica:
    """``python -m engine_svc.server`` on 127.0.0.1:PORT, as a Deployment's pod would run it."""

    def __init__(self, model_dir: Path, *engine_args: str, port: int | None = None) -> None:
        self.model_dir, self.engine_args = model_dir, engine_args
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="llmserve-replica-", suffix=".log", delete=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EngineReplica:
        cmd = [sys.executable, "-m", "engine_svc.server", "--model", str(self.model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *self.engine_args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, within_s: float = 120.0) -> None:
        deadline = time.monotonic() + within_s
        while True:
            assert self.proc.poll() is None, f"engine exited {self.proc.returncode}:\n{self.log_tail()}"
            try:
                self.stats()
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, f"engine not ready:\n{self.log_tail()}"
                time.sleep(0.2)

    def stats(self, check_invariants: bool = False) -> engine_pb2.EngineStats:
        with grpc.insecure_channel(self.address) as ch:
            return engine_pb2_grpc.EngineStub(ch).GetStats(
                engine_pb2.GetStatsRequest(check_invariants=check_invariants), timeout=10
            )

    def kill(self) -> None:
        """SIGKILL: the replica vanishes mid-step, as a node failure would take it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def close(self) -> None:
        self.stop()
        Path(self._log.name).unlink(missing_ok=True)


@contextlib.contextmanager
def replicas(model_dir: Path, count: int, *engine_args: str):
    """``count`` engines started side by side (their start-ups overlap), stopped at the end."""
    started = [EngineReplica(model_dir, *engine_args).start() for _ in range(count)]
    try:
        for r in started:
            r.wait_ready()
        yield started
    finally:
        for r in started:
            r.close()


def assert_pool_whole(replica: EngineReplica, within_s: float = 5.0) -> None:
    """The engine's invariant check passes, no block is held and no request is left."""

    def whole():
        st = replica.stats(check_invariants=True)
        assert not st.invariant_error, st.invariant_error
        return st.load.kv_blocks_used == 0 and st.num_live_requests == 0 and st.load.num_running == 0

    wait_for(whole, within_s, f"the pool of {replica.address} whole")


def segments_of(pids: set[int]) -> list[str]:
    return [name for name in list_segments() if creator_pid(name) in pids]
