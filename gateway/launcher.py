"""``llmserve serve``: the engine as a child process, then the gateway (and its tokenizer workers) here.

The engine runs as ``python -m engine_svc.server`` (a fresh interpreter: no fork after gRPC or
torch threads exist) on a unix socket in a private directory, and exits by itself if this process
dies. With ``--replicas K`` there are K such engines, each with its own socket and KV pool, behind
the gateway's router. With ``--engine ADDRESS`` (repeatable) no engine is started: the gateway joins
engines that run elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys

from engine_svc.kv_budget import KV_SHARE_ENV
from engine_svc.rpc.engine_options import engine_options_argv
from engine_svc.rpc.shm_segments import sweep_stale_segments
from engine_svc.rpc.socket_dir import make_private_dir, sweep_stale_dirs
from gateway.server import GatewayOptions, GatewayServer

log = logging.getLogger("gateway")


def client_hint(host: str, port: int, chat: bool = False) -> str:
    """A command whose answer a person can check: a chat question for a model with a chat template."""
    python = sys.executable
    rel = os.path.relpath(python)
    if not rel.startswith(".."):
        python = rel if os.sep in rel else f"./{rel}"
    target = f"{host}:{port}"
    if chat:
        return (
            f"echo 'What is the capital of France?' | {shlex.quote(python)} -m gateway chat "
            f"--target {target} --temperature 0 --max-tokens 32"
        )
    return (
        f"{shlex.quote(python)} -m gateway generate --target {target} --stream --max-tokens 32 "
        f'"Once upon a time"'
    )


def start_engine(args, socket_path: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "engine_svc.server",
        "--model",
        args.model,
        "--socket",
        socket_path,
        "--parent-pid",
        str(os.getpid()),
        "--log-level",
        args.log_level,
        *engine_options_argv(args),
    ]
    log.info("starting the engine: %s", shlex.join(cmd))
    env = None
    replicas = max(1, getattr(args, "replicas", 1) or 1)
    if replicas > 1:  # engines started together see the same free memory: each takes its share
        env = {**os.environ, KV_SHARE_ENV: str(replicas)}
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)


def stop_engines(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM to every engine first, then wait: replicas shut down side by side."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("the engine did not exit within %.0fs; killing it", timeout)
            proc.kill()
            proc.wait()


class EngineSupervisor:
    """The engine child, restarted (up to ``restarts`` times) when it dies after having served: the
    gateway reconnects to the new one on the same socket by itself, its clients see UNAVAILABLE for
    the streams that were open and NOT_SERVING until the new engine is warm."""

    def __init__(self, args, socket_path: str, restarts: int) -> None:
        self.args, self.socket_path, self.restarts_left = args, socket_path, restarts
        self.proc = start_engine(args, socket_path)

    def restart_if_dead(self, was_serving: bool) -> bool:
        if self.proc.poll() is None or not was_serving or self.restarts_left <= 0:
            return False
        self.restarts_left -= 1
        log.error(
            "the engine (pid %d) exited with code %s; restarting it (%d restart(s) left)",
            self.proc.pid,
            self.proc.returncode,
            self.restarts_left,
        )
        self.proc = start_engine(self.args, self.socket_path)
        print(f"llmserve: engine restarted, pid {self.proc.pid}", flush=True)
        return True


async def run_gateway(opts: GatewayOptions, supervisors: list[EngineSupervisor], print_hint: bool) -> int:
    """Serve until SIGTERM/SIGINT. ``supervisors``: the engines started here (none: ``--engine``)."""
    server = GatewayServer(opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def announce(gw: GatewayServer) -> None:
        if len(supervisors) == 1:
            where = f"engine pid {supervisors[0].proc.pid} at {opts.engine_address}"
        else:
            if supervisors:
                replicas = ", ".join(f"pid {s.proc.pid} at unix://{s.socket_path}" for s in supervisors)
                print(f"llmserve: engine replicas: {replicas}", flush=True)
            where = f"engine at {','.join(opts.engine_addresses) or opts.engine_address}"
        where += f", transport: {gw.state.engine.transport}"
        if gw.metrics_port is not None:
            print(f"llmserve: metrics on http://{opts.metrics_host}:{gw.metrics_port}/metrics", flush=True)
        if gw.http_port is not None:  # before the "serving" line: a reader of it knows both ports
            scheme = "https" if opts.tls is not None else "http"
            host = opts.http_host or opts.host
            print(f"llmserve: OpenAI-compatible HTTP API on {scheme}://{host}:{gw.http_port}/v1", flush=True)
        print(f"llmserve: serving {gw.state.model_name!r} on {opts.host}:{gw.port} ({where})", flush=True)
        if print_hint:
            tokenizer = gw.state.tokenizer
            chat = tokenizer is not None and tokenizer.has_chat_template
            print(f"Try it:\n  {client_hint(opts.host, gw.port, chat)}", flush=True)

    server.on_serving = announce
    await server.start()
    exit_code = 0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass
        for supervisor in supervisors:
            supervisor.restart_if_dead(server._announced)
        dead = [s.proc for s in supervisors if s.proc.poll() is not None]
        if dead and not server._announced:
            log.error("the engine exited with code %s before it was ready", dead[0].returncode)
            exit_code = 1
            break
    log.info("draining (grace %.1fs)", opts.drain_grace_s)
    await server.drain_and_stop()
    return exit_code


def serve(args, opts: GatewayOptions) -> int:
    removed = sweep_stale_segments()
    if removed:
        log.info("removed %d stale shared-memory segment(s)", len(removed))
    stale_dirs = sweep_stale_dirs()
    if stale_dirs:
        log.info("removed %d socket directory(ies) of dead launchers", len(stale_dirs))
    workdir = None
    supervisors: list[EngineSupervisor] = []
    try:
        if not opts.engine_address and not opts.engine_addresses:
            workdir = make_private_dir()  # /tmp/llmserve-<pid>-XXXXXXXX, 0700
            replicas = max(1, getattr(args, "replicas", 1))
            for i in range(replicas):  # each replica its own engine process, socket and KV pool
                name = "engine.sock" if replicas == 1 else f"engine-{i}.sock"
                supervisors.append(
                    EngineSupervisor(args, os.path.join(workdir, name), getattr(args, "engine_restarts", 0))
                )
            addresses = [f"unix://{s.socket_path}" for s in supervisors]
            opts.engine_address = addresses[0]
            opts.engine_addresses = addresses if replicas > 1 else []
        return _run_loop(run_gateway(opts, supervisors, print_hint=True))
    finally:
        stop_engines([s.proc for s in supervisors])
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _run_loop(coro) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is a Linux/macOS dependency; plain asyncio works too
        return asyncio.run(coro)
    return uvloop.run(coro)
