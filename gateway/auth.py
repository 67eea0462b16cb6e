"""API keys: who is calling, checked before any handler runs.

Keys live in a file named by ``--api-key-file``, one per line::

    # tenant   key
    acme       sk-3f9a...
    globex     sk-77c1...

A line with a key alone names the tenant after a digest of the key. The key is sent as gRPC
metadata ``authorization: Bearer <key>``. Only SHA-256 digests of the keys are kept in memory, and
a presented key is compared with every one of them by ``hmac.compare_digest`` without stopping at
the first match, so neither the content nor the position of a key leaks through timing.

The tenant is the caller's identity for everything that must not be shared between callers, the
prefix cache first: its salt comes from here and never from a field the client fills in.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("gateway.auth")

# Health is exempt: load balancers and orchestrators probe it without credentials.
EXEMPT_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class Identity:
    tenant: str

    @property
    def cache_salt(self) -> str:
        # A fixed prefix keeps tenant salts apart from any other salt the engine may ever be given;
        # the anonymous tenant (keys off) keeps the engine's unsalted cache.
        return f"tenant:{self.tenant}" if self.tenant else ""


ANONYMOUS = Identity("")  # the one identity when keys are off: every caller shares the cache


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, entries: Iterable[tuple[str, str]]) -> None:
        self._entries: list[tuple[bytes, Identity]] = []
        seen: set[bytes] = set()
        for tenant, key in entries:
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(f"the key of tenant {tenant!r} is shorter than {MIN_KEY_CHARS} characters")
            d = _digest(key)
            if d in seen:
                raise ValueError(f"the key of tenant {tenant!r} is listed twice")
            seen.add(d)
            self._entries.append((d, Identity(tenant)))
        if not self._entries:
            raise ValueError("no API keys given")

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        p = Path(path)
        mode = p.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("the API key file %s can be read by other users (mode %o)", p, mode)
        entries = []
        for n, raw in enumerate(p.read_text().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) == 1:
                entries.append(("key-" + _digest(parts[0]).hex()[:12], parts[0]))
            elif len(parts) == 2:
                entries.append((parts[0], parts[1]))
            else:
                raise ValueError(f"{p}:{n}: expected 'TENANT KEY' or 'KEY'")
        return cls(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def identify(self, key: str) -> Identity | None:
        presented = _digest(key)
        found = None
        for digest, identity in self._entries:  # no early exit: the time is the same for every key
            if hmac.compare_digest(presented, digest):
                found = identity
        return found


def bearer_token(metadata) -> str | None:
    """The token of the ``authorization: Bearer ...`` header, or None."""
    for k, v in metadata or ():
        if k.lower() == "authorization":
            if isinstance(v, bytes):
                v = v.decode("latin-1")
            scheme, _, token = v.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def api_key_header(metadata) -> str | None:
    """The key of an ``x-api-key`` header (Anthropic's clients send it), or None."""
    for k, v in metadata or ():
        if k.lower() == "x-api-key":
            v = v.decode("latin-1") if isinstance(v, bytes) else v
            return v.strip() or None
    return None


class Authenticator:
    """Maps a call's metadata to an Identity; with no keys configured, everyone is ANONYMOUS."""

    def __init__(self, keys: ApiKeys | None) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def identify(self, metadata) -> Identity | None:
        if self.keys is None:
            return ANONYMOUS
        token = bearer_token(metadata)
        if token is None:
            return None
        return self.keys.identify(token)

    def identify_http(self, headers) -> Identity | None:
        """An HTTP request's caller: ``Authorization: Bearer`` or, where that header is absent,
        Anthropic's ``x-api-key`` (gRPC takes the bearer token only)."""
        headers = list(headers)
        if self.keys is None or any(k.lower() == "authorization" for k, _ in headers):
            return self.identify(headers)
        key = api_key_header(headers)
        return None if key is None else self.keys.identify(key)

    def identity_of(self, context) -> Identity:
        """The caller of a call that the interceptor let through."""
        identity = self.identify(context.invocation_metadata())
        if identity is None:  # unreachable behind AuthInterceptor; refuse rather than share a cache
            raise PermissionError("unauthenticated call reached a handler")
        return identity


def _deny_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary/streaming) that answers UNAUTHENTICATED without reading
    the request: raw bytes in, nothing deserialized from a caller we do not know."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises; this makes the function a generator

    req_stream = handler.request_streaming if handler is not None else False
    resp_stream = handler.response_streaming if handler is not None else False
    if req_stream and resp_stream:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if req_stream:
        return grpc.stream_unary_rpc_method_handler(unary)
    if resp_stream:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, on_denied=None) -> None:
        self.auth = auth
        self.on_denied = on_denied  # called with the method name (a metrics counter)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not self.auth.enabled or method.startswith(EXEMPT_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        token = bearer_token(metadata)
        if token is not None and self.auth.keys.identify(token) is not None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        reason = "missing credentials" if token is None else "invalid API key"
        log.warning("refused %s: %s", method, reason)
        if self.on_denied is not None:
            self.on_denied(method)
        return _deny_handler(handler, f"{reason}: send 'authorization: Bearer <API key>' metadata")
