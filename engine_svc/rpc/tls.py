"""TLS for the public port and for the gateway-to-engine link over TCP.

Server side: a certificate and key, and optionally a client CA; with a client CA the server
requires a client certificate signed by it (mTLS) and refuses the handshake otherwise. Client
side (the gateway dialling an engine on another host, or any client): the CA that signed the
server's certificate, and optionally a client certificate and key for mTLS.

Files are read once at start; a missing or unreadable file is an error at start, not at the first
connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None or path == "":
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from e
    if b"-----BEGIN" not in data:
        raise ValueError(f"the {what} {path} is not PEM")
    return data


@dataclass(frozen=True)
class ServerTLS:
    cert: str
    key: str
    client_ca: str | None = None  # set: clients must present a certificate signed by this CA

    def credentials(self) -> grpc.ServerCredentials:
        cert = _read(self.cert, "certificate")
        key = _read(self.key, "private key")
        ca = _read(self.client_ca, "client CA")
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )


@dataclass(frozen=True)
class ClientTLS:
    ca: str | None = None  # None: the system's roots
    cert: str | None = None  # a client certificate, for a server that requires mTLS
    key: str | None = None
    server_name: str | None = None  # the name to check the certificate against, if not the host

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate and its key go together")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"),
            private_key=_read(self.key, "private key"),
            certificate_chain=_read(self.cert, "certificate"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_tls_from_args(cert: str | None, key: str | None, client_ca: str | None) -> ServerTLS | None:
    """None when TLS is off; a clear error for half a configuration."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    tls = ServerTLS(cert, key, client_ca)
    tls.credentials()  # read and check the files now
    return tls


def add_port(server, address: str, tls: ServerTLS | None) -> int:
    """Listen on ``address``, with TLS when configured; returns the bound port (0: failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


def client_tls_from_args(
    ca: str | None, cert: str | None, key: str | None, server_name: str | None = None
) -> ClientTLS | None:
    if ca is None and cert is None and key is None:
        return None
    tls = ClientTLS(ca, cert, key, server_name)
    tls.credentials()
    return tls
