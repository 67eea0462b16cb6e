"""What every fault, security and soak test shares: the end-of-test cleanliness checks, process
facts read from /proc, and an asyncio client for many concurrent streams."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import grpc
import pytest

from engine_svc.rpc.shm_segments import creator_pid, list_segments
from gateway.client import build_request
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.service_process import ServiceProcess

_RESTARTED = re.compile(r"^llmserve: engine restarted, pid (\d+)")
_METRICS = re.compile(r"^llmserve: metrics on http://([\d.]+):(\d+)/metrics")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def memory_bytes(pid: int) -> dict[str, int]:
    """The resident set and its parts: ``anon`` (private heap: where a leak shows), ``shmem``
    (shared-memory rings, mapped whole from the start) and ``rss`` (everything)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssShmem": "shmem"}
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in fields:
            out[fields[key]] = int(line.split()[1]) * 1024
    if len(out) != len(fields):
        raise RuntimeError(f"no memory figures for {pid}")
    return out


def wait_for(predicate, within_s: float, what: str, every_s: float = 0.05):
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s}s")
        time.sleep(every_s)


def engine_pid(sp: ServiceProcess) -> int:
    """The current engine's pid (the launcher prints a new one after each restart)."""
    pid = sp.engine_pid
    for line in sp.stdout_lines:
        m = _RESTARTED.match(line)
        if m:
            pid = int(m.group(1))
    return pid


def metrics_port(sp: ServiceProcess) -> int:
    for line in sp.stdout_lines:
        m = _METRICS.match(line)
        if m:
            return int(m.group(2))
    raise AssertionError("the service printed no metrics address")


def assert_engine_clean(sp: ServiceProcess, within_s: float = 30.0) -> None:
    """The pool is whole (the engine's invariant check: free + used = total, every ref count held
    by a live sequence), no block in use, and no request left, once in-flight aborts have landed
    (``within_s`` bounds a hang, not how fast they land)."""

    def clean():
        st = sp.engine_stats(check_invariants=True)
        assert not st.invariant_error, st.invariant_error
        load = st.load
        return (
            st
            if (load.kv_blocks_used, load.num_running, load.num_waiting, st.num_live_requests)
            == (
                0,
                0,
                0,
                0,
            )
            else None
        )

    try:
        wait_for(clean, within_s, "the engine did not return to idle")
    except AssertionError:
        raise AssertionError(f"engine not clean: {sp.engine_stats(check_invariants=True)}") from None


def assert_no_segments_of(pids) -> None:
    left = [n for n in list_segments() if creator_pid(n) in set(pids)]
    assert not left, f"shared-memory segments left behind: {left}"


def stop_and_check(sp: ServiceProcess, extra_pids=()) -> None:
    """SIGTERM the service; it exits 0, and no child process or segment of ours outlives it."""
    children = sp.descendants()
    pids = {sp.pid, *children, *extra_pids}
    assert sp.terminate(60) == 0, sp.log_tail()
    wait_for(lambda: not any(alive(p) for p in children), 30, "child processes outlived the service")
    assert_no_segments_of(pids)


async def stream_all(target: str, requests: list, metadata=None, timeout: float = 120.0):
    """Run GenerateStream calls concurrently on one channel; each result is its list of messages
    or the grpc.aio.AioRpcError it ended with."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gen_grpc.GenerationStub(ch)

        async def one(req):
            try:
                return [m async for m in stub.GenerateStream(req, metadata=metadata, timeout=timeout)]
            except grpc.aio.AioRpcError as e:
                return e

        return await asyncio.gather(*(one(r) for r in requests))


def token_ids_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


__all__ = ["build_request"]


class OpenStreams:
    """Streams started now and drained by threads: ``results[i]`` is the list of messages or the
    grpc.RpcError the stream ended with; ``ended_at[i]`` is when it ended."""

    def __init__(self, client, prompts: list[str], **options) -> None:
        import threading

        self.calls = [client.generate_stream(p, **options) for p in prompts]
        self.results: dict[int, object] = {}
        self.ended_at: dict[int, float] = {}
        self.last_message_at: dict[int, float] = {}
        self.first = [next(iter(c)) for c in self.calls]  # every stream is running
        self._threads = [
            threading.Thread(target=self._drain, args=(i,), daemon=True) for i in range(len(self.calls))
        ]
        for t in self._threads:
            t.start()

    def _drain(self, i: int) -> None:
        msgs = [self.first[i]]
        try:
            for m in self.calls[i]:
                msgs.append(m)
                self.last_message_at[i] = time.monotonic()
            self.results[i] = msgs
        except grpc.RpcError as e:
            self.results[i] = e
        self.ended_at[i] = time.monotonic()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, t in enumerate(self._threads) if t.is_alive()]
        assert not hung, f"streams {hung} did not end within {timeout_s}s"

    def codes(self) -> list:
        return [
            r.code() if isinstance(r, grpc.RpcError) else grpc.StatusCode.OK for r in self.results.values()
        ]


def loss_reasons(streams: OpenStreams) -> list[str]:
    """Why the gateway said each stream's engine was lost: ``closed`` (the engine ended the session:
    its watchdog, its loop failing), ``error`` (the connection broke), ``heartbeat_timeout``,
    ``hung`` (the gateway's watchdog); ``?`` for a stream that did not end that way."""
    out = []
    for r in streams.results.values():
        m = _LOST.search(r.details() or "") if isinstance(r, grpc.RpcError) else None
        out.append(m.group(1) if m else "?")
    return out


_LOST = re.compile(r"the engine is unavailable \((\w+)\)")


class FaultTrigger:
    """The files that arm an injected forward-pass fault and end its stall
    (``engine_svc/server/fault_injection.py``): the fault waits for the test to say its streams are
    open, and a stall lasts until the test has seen what it causes, on a machine of any speed."""

    def __init__(self, directory: Path) -> None:
        self.armed_by = Path(directory) / "fault-armed"
        self.stall_until = Path(directory) / "fault-stall-over"

    def env(self, raise_at: int = 0, stall_at: int = 0) -> dict[str, str]:
        env = {
            "LLMSERVE_FAULT_ARMED_BY": str(self.armed_by),
            "LLMSERVE_FAULT_STALL_UNTIL": str(self.stall_until),
        }
        if raise_at:
            env["LLMSERVE_FAULT_FORWARD_RAISE_AT_STEP"] = str(raise_at)
        if stall_at:
            env["LLMSERVE_FAULT_FORWARD_STALL_AT_STEP"] = str(stall_at)  # for an hour, or until released
        return env

    def arm(self) -> None:
        self.armed_by.touch()

    def end_stall(self) -> None:
        self.stall_until.touch()


def engine_pids(sp: ServiceProcess) -> list[int]:
    """Every engine this service has had (the first, then one per restart)."""
    pids = [sp.engine_pid] if sp.engine_pid else []
    return pids + [int(m.group(1)) for line in sp.stdout_lines if (m := _RESTARTED.match(line))]


def assert_segments_only_of_live_sessions(sp: ServiceProcess) -> None:
    """No segment of an engine of this service that is gone, and the live engine holds exactly the
    two rings of each open session (no ring of a closed session is left)."""
    names = list_segments()
    ours = {sp.pid, *engine_pids(sp)}
    dead = [n for n in names if creator_pid(n) in ours and not alive(creator_pid(n))]
    assert not dead, f"segments of dead processes: {dead}"
    pid = engine_pid(sp)
    mine = [n for n in names if creator_pid(n) == pid]
    sessions = sp.engine_stats().num_sessions
    rings = 2 if sp.transport == "shared-memory" else 0  # a gRPC-transport session has none
    assert len(mine) == rings * sessions, (mine, sessions, sp.transport)


@pytest.fixture(autouse=True)
def ends_clean(request):
    """After each test of a module using the ``svc`` fixture: the pool whole, no request left, no ring
    of a closed session left. Import it into a test module to apply it there."""
    yield
    if "svc" in request.fixturenames:
        sp = request.getfixturevalue("svc")
        assert_engine_clean(sp)
        assert_segments_only_of_live_sessions(sp)
