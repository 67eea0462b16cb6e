"""The engine and the gateway started alone, joined over TCP (as on two hosts); an engine restart
brings the service back without restarting the gateway."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from grpc_health.v1 import health_pb2

from gateway.client import LLMServeClient
from tests.service_process import ServiceProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_dir, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine_svc.server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-kv-blocks",
            "256",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_status(client: LLMServeClient, status: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while client.health_status() != status:
        assert time.monotonic() < deadline, f"health did not become {status}"
        time.sleep(0.1)


def test_gateway_joins_a_tcp_engine_and_survives_its_restart(default_model_dir):
    port = free_port()
    engine = start_engine(default_model_dir, port)
    try:
        with ServiceProcess(
            default_model_dir, "--engine", f"127.0.0.1:{port}", "--tokenizer-workers", "0"
        ) as sp:
            assert sp.transport == "grpc"  # no shared memory across hosts
            assert sp.descendants() == []  # it started no engine of its own
            with LLMServeClient(sp.target, timeout=60) as client:
                first = client.generate("over TCP", max_tokens=8, temperature=0.0, return_token_ids=True)
                assert len(first.token_ids) == 8
                engine.terminate()
                assert engine.wait(30) == 0
                wait_status(client, health_pb2.HealthCheckResponse.NOT_SERVING, 6.0)
                engine = start_engine(default_model_dir, port)
                wait_status(client, health_pb2.HealthCheckResponse.SERVING, 90.0)
                again = client.generate("over TCP", max_tokens=8, temperature=0.0, return_token_ids=True)
                assert list(again.token_ids) == list(first.token_ids)
    finally:
        engine.terminate()
        engine.wait(30)
