"""gRPC channel arguments shared by both ends: message size limits and keepalive.

Keepalive: each side pings a quiet connection so that a long stream whose tokens come slowly (or a
gateway's engine session between bursts) is not dropped by a NAT or load balancer idling it out,
and a peer that vanished without a FIN is noticed. The server permits client pings at the rate
clients are told to use, and no faster (a ping flood is answered with GOAWAY).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keepalive:
    time_ms: int = 30_000  # ping after this long without activity
    timeout_ms: int = 10_000  # the peer is gone if the ping is not acknowledged in time
    min_client_ping_interval_ms: int = 10_000  # the server refuses more frequent client pings

    def server_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", self.time_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_client_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", 2),
        ]

    def client_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", max(self.time_ms, self.min_client_ping_interval_ms)),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]


def message_size_options(max_receive_bytes: int, max_send_bytes: int | None = None) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", max_send_bytes if max_send_bytes is not None else max_receive_bytes),
    ]
