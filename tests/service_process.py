"""Run the whole service (``python -m gateway serve``) as a child process: for tests and benchmarks.

It waits for the launcher's "serving" line, which also names the engine's pid and address, so a
caller can query the engine's stats, kill it, or check that nothing is left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from llmserve_proto.engine.v1 import engine_pb2, engine_pb2_grpc

_SERVING = re.compile(
    r"^llmserve: serving '.*' on (\S+):(\d+) \((?:engine pid (\d+)|engine) at (\S+), transport: ([\w-]+)\)"
)

_HTTP = re.compile(r"^llmserve: OpenAI-compatible HTTP API on https?://\S+:(\d+)/v1")


class ServiceProcess:
    def __init__(
        self,
        model_dir: str | Path,
        *args: str,
        port: int = 0,
        startup_timeout_s: float = 180.0,
        env: dict | None = None,
    ) -> None:
        self.cmd = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
        ]
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        # The server keeps a disk tier of the prefix cache by default. Tests keep it under their
        # run's own LLMSERVE_CACHE (conftest.py); a benchmark's server, without one, in a folder of
        # its own removed with it, so that no run is served what an earlier run computed.
        self._kv_dir = None
        if "LLMSERVE_CACHE" not in self.env and "--kv-disk-dir" not in args:
            self._kv_dir = tempfile.mkdtemp(prefix="llmserve-kv-")
            self.cmd += ["--kv-disk-dir", self._kv_dir]
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.engine_pid: int | None = None
        self.engine_address = ""
        self.transport = ""
        self.http_port = 0  # with --http-port
        self.stdout_lines: list[str] = []
        self._log = tempfile.NamedTemporaryFile(prefix="llmserve-service-", suffix=".log", delete=False)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> ServiceProcess:
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=self.env,
            stdin=subprocess.DEVNULL,
        )
        ready = threading.Event()

        def read_stdout() -> None:
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                h = _HTTP.match(line)
                if h:
                    self.http_port = int(h.group(1))
                m = _SERVING.match(line)
                if m and not ready.is_set():
                    self.port = int(m.group(2))
                    self.engine_pid = int(m.group(3)) if m.group(3) else None
                    self.engine_address, self.transport = m.group(4), m.group(5)
                    ready.set()

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.kill()
                raise RuntimeError(f"the service did not start (exit {self.proc.returncode}):\n{tail}")
        return self

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def engine_stats(self, check_invariants: bool = False) -> engine_pb2.EngineStats:
        with grpc.insecure_channel(self.engine_address) as ch:
            return engine_pb2_grpc.EngineStub(ch).GetStats(
                engine_pb2.GetStatsRequest(check_invariants=check_invariants), timeout=10
            )

    def descendants(self) -> list[int]:
        """Every live process below the launcher (engine, tokenizer workers, their helpers)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    children = [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    continue
                out += children
                todo += children
        return sorted(set(out))

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a graceful drain) and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the whole tree and remove the log: the end of a test or benchmark."""
        if self.proc is None:
            return
        pids = self.descendants() if self.proc.poll() is None else []
        for pid in [self.proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._remove_files()

    def _remove_files(self) -> None:
        Path(self._log.name).unlink(missing_ok=True)
        if self._kv_dir is not None:
            shutil.rmtree(self._kv_dir, ignore_errors=True)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.terminate(30)
            except subprocess.TimeoutExpired:
                pass
        self._remove_files()
