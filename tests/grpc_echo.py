"""A raw-bytes echo service with all four RPC kinds, and the standard health service, on grpc.aio:
a real server to put interceptors and credentials in front of, without the model behind it."""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

SERVICE = "test.Echo"
KINDS = ("Unary", "ServerStream", "ClientStream", "Bidi")


def _metadata(context) -> tuple:
    # A copy taken inside the handler: a call's context must not be read after the call has ended.
    return tuple(context.invocation_metadata())


def echo_handlers(seen: list):
    async def unary(request, context):
        seen.append(("Unary", _metadata(context)))
        return request

    async def server_stream(request, context):
        seen.append(("ServerStream", _metadata(context)))
        for _ in range(3):
            yield request

    async def client_stream(requests, context):
        seen.append(("ClientStream", _metadata(context)))
        return b"".join([r async for r in requests])

    async def bidi(requests, context):
        seen.append(("Bidi", _metadata(context)))
        async for r in requests:
            yield r

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )


class EchoServer:
    """Runs the server on an event loop in a thread, so tests call it with the sync client."""

    def __init__(self, interceptors=(), add_port=None) -> None:
        self.interceptors = list(interceptors)
        self.add_port = add_port or (lambda server: server.add_insecure_port("127.0.0.1:0"))
        self.seen: list = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server = None

    def __enter__(self) -> EchoServer:
        ready = threading.Event()

        async def main():
            self._server = grpc.aio.server(interceptors=self.interceptors)
            self._server.add_generic_rpc_handlers((echo_handlers(self.seen),))
            health = HealthServicer()
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(health, self._server)
            self.port = self.add_port(self._server)
            await self._server.start()
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()
            await self._server.stop(0)

        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(main(),), daemon=True)
        self._thread.start()
        assert ready.wait(10), "the echo server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the echo server did not stop"
        self._loop.close()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


def call(channel: grpc.Channel, kind: str, payload: bytes = b"hi", metadata=None, timeout: float = 5.0):
    """Make one call of ``kind`` and return what came back (raises grpc.RpcError)."""
    path = f"/{SERVICE}/{kind}"
    if kind == "Unary":
        return channel.unary_unary(path)(payload, metadata=metadata, timeout=timeout)
    if kind == "ServerStream":
        return list(channel.unary_stream(path)(payload, metadata=metadata, timeout=timeout))
    if kind == "ClientStream":
        return channel.stream_unary(path)(iter([payload, payload]), metadata=metadata, timeout=timeout)
    return list(channel.stream_stream(path)(iter([payload, payload]), metadata=metadata, timeout=timeout))


def health_check(channel: grpc.Channel, metadata=None) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), metadata=metadata, timeout=5).status
