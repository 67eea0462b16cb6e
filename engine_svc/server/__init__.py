"""The engine process: engine.v1 and grpc.health.v1 over gRPC (unix socket or TCP) around one engine loop.

Run it with ``python -m engine_svc.server --model DIR``. The shared-memory modules here
(``shm_segments``, ``shm_ring``) import neither torch nor the engine, so the gateway uses them too.
"""
