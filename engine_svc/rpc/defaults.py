"""Default ports and health names, in one place: the CLIs, the client, the engine server and the
deploy/ manifests' test read them here."""

from __future__ import annotations

GATEWAY_PORT = 50051  # llmserve.v1 (Generation, Models, grpc.health.v1, reflection)
ENGINE_TCP_PORT = 50061  # engine.v1 and grpc.health.v1 when the engine listens on TCP (another host)
LIVENESS_SERVICE = "llmserve.liveness"  # the gateway's grpc.health.v1 name, SERVING while the process runs
