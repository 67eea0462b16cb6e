"""grpc.health.v1 for the engine process, on the same server (and port, and TLS) as engine.v1.

"" and the engine's own service name are SERVING once the model is loaded and warmed up and the loop
has answered a command; NOT_SERVING while the watchdog says the loop is stuck, and for good from the
moment the process starts to shut down. A probe reads the status without going through the engine
loop: a stuck loop must still be reported as stuck, not as a probe that times out. Watch comes from
the stock servicer (non-blocking, so a watcher does not hold one of the server's threads).
"""

from __future__ import annotations

import logging
import threading

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from llmserve_proto.engine.v1 import engine_pb2 as pb

log = logging.getLogger("engine_svc.server")
ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name  # "engine.v1.Engine"
HEALTH_NAMES = ("", ENGINE_SERVICE)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EngineHealth:
    def __init__(self) -> None:
        self.servicer = HealthServicer()
        self._lock = threading.Lock()  # the watchdog's thread, the loop and main all report
        self._serving: bool | None = None
        self._closing = False
        self.set_serving(False)  # the stock servicer starts "" as SERVING; nothing is ready yet

    def add_to(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def set_serving(self, serving: bool) -> None:
        with self._lock:
            if self._closing or serving == self._serving:
                return
            self._serving = serving
            for name in HEALTH_NAMES:
                self.servicer.set(name, SERVING if serving else NOT_SERVING)
            log.info("health: %s", "SERVING" if serving else "NOT_SERVING")

    def shutting_down(self) -> None:
        """NOT_SERVING from now on (watchers are told); later set_serving calls change nothing."""
        with self._lock:
            self._closing = True
            self._serving = False
            self.servicer.enter_graceful_shutdown()
        log.info("health: NOT_SERVING (shutting down)")
