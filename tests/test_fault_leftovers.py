"""Nothing left behind, and honest logs (issue 17), through a real service.

- The private socket directory (/tmp/llmserve-<launcher pid>-XXXXXXXX) is removed even when the
  launcher is SIGKILLed: its engine, exiting because its parent is gone, removes it; one that
  still lingers (both killed at once) is swept by the next start, as stale rings are.
- The request log's completion_tokens counts the tokens sent, also for a cancelled request
  (before the fix: 0 after 100-3,900 tokens).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from engine_svc.rpc.socket_dir import owner_pid, sweep_stale_dirs
from gateway.client import LLMServeClient
from tests.fault_helpers import alive, stop_and_check, wait_for
from tests.service_process import ServiceProcess


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def stale_socket_dir(root: Path) -> Path:
    """What a killed launcher leaves: its 0700 directory with an engine socket in it."""
    d = root / f"llmserve-{dead_pid()}-stale_ab"
    d.mkdir(mode=0o700)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "engine.sock"))
    s.close()
    return d


def test_the_sweep_removes_only_directories_of_dead_launchers():
    # A short directory of its own: a socket's path must fit AF_UNIX's 108 bytes, and pytest's
    # tmp_path under a parallel worker (pytest-of-USER/pytest-N/popen-gwK/...) can pass that.
    with tempfile.TemporaryDirectory(prefix="lsw-") as tmp:
        _sweep_case(Path(tmp))


def _sweep_case(tmp_path: Path) -> None:
    stale = stale_socket_dir(tmp_path)
    live = tmp_path / f"llmserve-{os.getpid()}-live_abc"
    live.mkdir()
    other = tmp_path / "llmserve-notours"
    other.mkdir()
    kept = tmp_path / f"llmserve-{dead_pid()}-keepfile"
    kept.mkdir()
    (kept / "data.txt").write_text("not a socket: not ours to delete")
    assert sweep_stale_dirs(tmp_path) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists() and kept.exists()


def test_a_sigkilled_launcher_leaves_no_socket_directory(tiny_llama):
    leftover = stale_socket_dir(Path(tempfile.gettempdir()))  # as if an earlier launcher was killed
    sp = ServiceProcess(tiny_llama, "--transport", "shm", "--num-kv-blocks", "64").start()
    try:
        assert not leftover.exists(), "the start did not sweep a dead launcher's directory"
        sock_dir = Path(sp.engine_address.removeprefix("unix://")).parent
        assert owner_pid(sock_dir) == sp.pid and sock_dir.is_dir()
        assert (sock_dir.stat().st_mode & 0o777) == 0o700
        engine = sp.engine_pid
        os.kill(sp.pid, signal.SIGKILL)
        sp.proc.wait()
        wait_for(lambda: not alive(engine), 60, "the engine outlived its launcher")
        wait_for(lambda: not sock_dir.exists(), 30, f"{sock_dir} was left behind")
    finally:
        sp.kill()


@pytest.fixture(scope="module")
def svc(tiny_llama):
    sp = ServiceProcess(
        tiny_llama, "--transport", "shm", "--num-kv-blocks", "256", "--log-format", "json"
    ).start()
    try:
        yield sp
        stop_and_check(sp)
    finally:
        sp.kill()


def finished_line(sp: ServiceProcess, request_id: str) -> dict:
    def find():
        for line in Path(sp._log.name).read_text(errors="replace").splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("request_id") == request_id and entry.get("msg") == "finished":
                    return entry
        return None

    return wait_for(find, 60, f"no 'finished' log line for {request_id}")


def test_the_request_log_counts_the_tokens_sent_to_a_client_that_cancels(svc):
    # Small flow-control windows: the server cannot run far ahead of what this client reads, so the
    # request is still running when the client cancels (a default client could have been sent all
    # 900 tokens of the tiny model by then).
    slow = grpc.insecure_channel(
        svc.target, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    )
    with slow, LLMServeClient(svc.target, timeout=60, channel=slow) as c:
        call = c.generate_stream(
            "count me", request_id="cancel-me", max_tokens=900, ignore_eos=True, return_token_ids=True
        )
        received = last = 0
        for msg in call:
            last = len(msg.token_ids)
            received += last
            if received >= 40:
                break
        call.cancel()
        entry = finished_line(svc, "cancel-me")
        assert entry["outcome"] == "cancelled"
        # gRPC may have delivered the last message just as the cancel ended its send: at most that
        # one is not counted.
        assert received - last <= entry["completion_tokens"] < 900, (received, entry)

    with LLMServeClient(svc.target, timeout=60) as c:
        out = c.generate("count me too", request_id="whole", max_tokens=24, ignore_eos=True)
        entry = finished_line(svc, "whole")
        assert (
            entry["outcome"] == "length" and entry["completion_tokens"] == out.usage.completion_tokens == 24
        )
