"""The gateway's gRPC server: services, health, reflection, and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from engine_svc.rpc.defaults import GATEWAY_PORT, LIVENESS_SERVICE
from engine_svc.rpc.grpc_options import Keepalive, message_size_options
from engine_svc.rpc.tls import ClientTLS, ServerTLS, add_port
from gateway.adapters_service import AdaptersService
from gateway.admission import Admission
from gateway.auth import Authenticator, AuthInterceptor
from gateway.embedding_service import EmbeddingService
from gateway.engine_client import EngineClient
from gateway.gateway_state import GatewayState
from gateway.generation_service import GenerationService
from gateway.http_api import HttpApi, HttpServer
from gateway.infill import model_fim
from gateway.limits import Limits
from gateway.metrics import GatewayMetrics
from gateway.model_digest import ModelDigest
from gateway.models_service import ModelsService
from gateway.prompt_log import PromptLogPolicy
from gateway.replica_set import connect_engines
from gateway.router import RoutingPolicy
from gateway.router_service import RouterService
from gateway.stall_sweep import StallSweeper
from gateway.tool_request import ToolOptions
from gateway.wire_guard import DecodeGuardInterceptor
from llmserve_proto.llmserve.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    embeddings_pb2,
    embeddings_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tokenizer_svc.pool import TokenizerPool
from tokenizer_svc.tokenizer import load_tokenizer

log = logging.getLogger("gateway")
SERVICES = [
    generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    models_pb2.DESCRIPTOR.services_by_name["Models"].full_name,
    router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
    adapters_pb2.DESCRIPTOR.services_by_name["Adapters"].full_name,
    embeddings_pb2.DESCRIPTOR.services_by_name["Embeddings"].full_name,
]


@dataclass
class GatewayOptions:
    model_dir: str
    engine_address: str
    host: str = "127.0.0.1"
    port: int = GATEWAY_PORT
    served_model_name: str | None = None
    tokenizer_workers: int = 1
    use_shared_memory: bool = False  # measured no faster end to end (benchmarks/transports.py)
    limits: Limits = field(default_factory=Limits)
    drain_grace_s: float = 10.0
    heartbeat_timeout_s: float = 5.0
    auth: Authenticator = field(default_factory=lambda: Authenticator(None))
    tls: ServerTLS | None = None
    engine_tls: ClientTLS | None = None  # the link to an engine over TCP
    keepalive: Keepalive = field(default_factory=Keepalive)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    watchdog_timeout_s: float = 30.0
    log_prompts: bool = False
    engine_addresses: list[str] = field(default_factory=list)  # several: replicas (engine_address unused)
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    http_port: int | None = None  # the OpenAI-compatible HTTP API; None: off, 0: any free port
    http_host: str | None = None  # None: the same host as the gRPC port
    # Token-only serving: no tokenizer is loaded and no tokenizer worker started (prompts and
    # outputs are token ids; text fields are refused).
    skip_tokenizer_init: bool = False
    tool_options: ToolOptions = field(default_factory=ToolOptions)
    fim_order: str = ""  # --fim-order: "" is each FIM family's own
    chat_template: str | None = None  # a Jinja file that replaces the model's chat template


class GatewayServer:
    def __init__(self, opts: GatewayOptions) -> None:
        self.opts = opts
        self.port: int | None = None
        self.health = HealthServicer()
        self.on_serving: Callable[[GatewayServer], None] | None = (
            None  # called when health first turns SERVING
        )
        self._announced = False
        self._server: grpc.aio.Server | None = None
        self.state: GatewayState | None = None
        self.metrics = GatewayMetrics()
        self.metrics_port: int | None = None
        self.stall_sweeper: StallSweeper | None = None
        self.http: HttpServer | None = None
        self.http_port: int | None = None

    async def start(self) -> None:
        o = self.opts
        tokenizer = tokenization = None
        if not o.skip_tokenizer_init:
            tokenizer = load_tokenizer(o.model_dir, o.chat_template)
            tokenization = TokenizerPool(o.model_dir, o.tokenizer_workers, o.chat_template)
            await tokenization.start()
        engine = connect_engines(  # several addresses: replicas behind the prefix-affinity router
            o.engine_addresses or [o.engine_address],
            lambda address: EngineClient(
                address,
                use_shared_memory=o.use_shared_memory,
                heartbeat_timeout_s=o.heartbeat_timeout_s,
                tls=o.engine_tls,
                watchdog_timeout_s=o.watchdog_timeout_s,
                max_message_bytes=max(o.limits.max_message_bytes, 64 << 20),
                keepalive=o.keepalive,
                max_unsent_messages=o.limits.max_unsent_messages,
                max_unsent_bytes=o.limits.max_unsent_bytes,
                max_unsent_tokens=o.limits.max_unsent_tokens,
                pause_after_s=o.limits.stream_pause_after_s,
            ),
            o.routing,
        )
        engine.on_state_change = self._engine_state_changed
        m = self.metrics
        engine.on_step_time = m.step_time.observe
        engine.on_lost = lambda reason: m.engine_lost.labels(reason=reason).inc()
        model_name = o.served_model_name or Path(o.model_dir).resolve().name
        tool_options = o.tool_options.for_template(
            tokenizer.chat_template_text if tokenizer is not None else ""
        )
        if tool_options != o.tool_options:
            log.info(
                "tool calls: parser %s, tool_choice auto %s (from the chat template)",
                tool_options.tool_call_parser,
                "on" if tool_options.enable_auto_tool_choice else "off",
            )
        m.watch_engine(lambda: engine.load if engine.ready else None, model_name)
        self.state = GatewayState(
            model_name=model_name,
            tokenizer=tokenizer,
            tokenization=tokenization,
            engine=engine,
            limits=o.limits,
            admission=Admission(
                o.limits.max_concurrent_requests,
                o.limits.max_queue_length,
                o.limits.new_client_slot_count(),
            ),
            auth=o.auth,
            metrics=m,
            prompt_log=PromptLogPolicy(o.log_prompts),
            tool_options=tool_options,
            fim=model_fim(o.model_dir, tokenizer, o.fim_order) if tokenizer is not None else None,
            model_digest=ModelDigest(o.model_dir),
        )
        self.stall_sweeper = StallSweeper(
            self.state.streams, o.limits.stream_stall_timeout_s, o.limits.max_paused_streams
        )
        server = grpc.aio.server(
            # Credentials first: nothing from an unknown caller is even parsed.
            interceptors=[
                AuthInterceptor(o.auth, on_denied=lambda _: m.auth_failures.inc()),
                DecodeGuardInterceptor(),
            ],
            options=[
                *message_size_options(o.limits.max_message_bytes),
                *o.keepalive.server_options(),
                ("grpc.so_reuseport", 0),
            ],
        )
        generation = GenerationService(self.state)
        generation_pb2_grpc.add_GenerationServicer_to_server(generation, server)
        models_pb2_grpc.add_ModelsServicer_to_server(ModelsService(self.state), server)
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(self.state), server)
        adapters_pb2_grpc.add_AdaptersServicer_to_server(AdaptersService(self.state), server)
        embeddings = EmbeddingService(self.state, generation)
        embeddings_pb2_grpc.add_EmbeddingsServicer_to_server(embeddings, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for name in ("", *SERVICES):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        # The process answers: alive, engines or not (a liveness probe must not restart a gateway
        # that waits for its engines; readiness asks "" instead).
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(
            [*SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        self.port = add_port(server, f"{o.host}:{o.port}", o.tls)
        if self.port == 0:
            raise OSError(f"cannot listen on {o.host}:{o.port}")
        if o.metrics_port is not None:
            self.metrics_port = m.serve(o.metrics_host, o.metrics_port)
        await server.start()
        self._server = server
        if o.http_port is not None:  # on this same loop: tasks of uvicorn's, no thread
            self.http = HttpServer(HttpApi(self.state, generation), o.http_host or o.host, o.http_port, o.tls)
            self.http_port = await self.http.start()
        self.stall_sweeper.start()
        await engine.start()
        log.info(
            "gateway listening on %s:%d; waiting for the engine at %s",
            o.host,
            self.port,
            o.engine_address,
            extra={
                "fields": {
                    "tls": "off" if o.tls is None else ("mtls" if o.tls.client_ca else "on"),
                    "api_keys": len(o.auth.keys) if o.auth.enabled else 0,
                    "engine_tls": o.engine_tls is not None,
                    "metrics": f"{o.metrics_host}:{self.metrics_port}" if self.metrics_port else "off",
                    "http": f"{o.http_host or o.host}:{self.http_port}" if self.http_port else "off",
                    "log_prompts": o.log_prompts,
                    "token_only": o.skip_tokenizer_init,
                }
            },
        )

    def _engine_state_changed(self, ready: bool) -> None:
        asyncio.get_running_loop().create_task(self._set_health(ready))

    async def _set_health(self, ready: bool) -> None:
        if self.state.draining:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICES):
            await self.health.set(name, status)
        if ready and not self._announced:
            self._announced = True
            if self.on_serving is not None:
                self.on_serving(self)

    async def drain_and_stop(self) -> None:
        """Stop admitting, let requests in flight finish for the grace period, abort the rest, stop."""
        s = self.state
        s.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.opts.drain_grace_s
        while s.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if s.inflight:
            log.warning(
                "drain: aborting %d request(s) still running after %.1fs",
                len(s.inflight),
                self.opts.drain_grace_s,
            )
            s.abort_all()
            end = time.monotonic() + 2.0
            while s.inflight and time.monotonic() < end:
                await asyncio.sleep(0.02)
        if self.http is not None:
            await self.http.stop()
        await self._server.stop(grace=1.0)
        await self.stall_sweeper.stop()
        await s.engine.close()
        if s.tokenization is not None:
            await s.tokenization.close()
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
