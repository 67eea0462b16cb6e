"""gRPC plumbing that the engine process and the gateway share: TLS, channel options, logging, default
ports and health names.

It lives under engine_svc so that the engine never imports the gateway (the gateway is the engine's
client, so that import may only go the other way). Nothing here imports torch or the engine.
"""
