"""Default ports, in one place: the CLI, the client and the deploy/ manifests' test read them here."""

from __future__ import annotations

GATEWAY_PORT = 50051  # llmserve.v1 (Generation, Models, grpc.health.v1, reflection)
ENGINE_TCP_PORT = 50061  # engine.v1 when the engine listens on TCP (another host)
LIVENESS_SERVICE = "llmserve.liveness"  # grpc.health.v1 name that is SERVING while the process runs
