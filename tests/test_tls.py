"""TLS and mTLS on a real server: the right CA connects; plaintext, a foreign CA, a missing or
foreign client certificate do not."""

from __future__ import annotations

import grpc
import pytest

from engine_svc.rpc.tls import ClientTLS, ServerTLS, add_port, client_tls_from_args, server_tls_from_args
from tests.grpc_echo import EchoServer, call
from tests.tls_certs import make_tls_material


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def _server(tls_config: ServerTLS) -> EchoServer:
    return EchoServer(add_port=lambda s: add_port(s, "127.0.0.1:0", tls_config))


def _secure_call(target: str, client: ClientTLS, timeout: float = 5.0):
    with grpc.secure_channel(target, client.credentials(), options=client.channel_options()) as ch:
        return call(ch, "Unary", b"x", timeout=timeout)


def _refused(fn) -> None:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value


def test_tls_server_talks_to_a_client_that_trusts_its_ca_only(tls):
    with _server(ServerTLS(str(tls.server.cert), str(tls.server.key))) as server:
        assert _secure_call(server.target, ClientTLS(ca=str(tls.ca.cert_path))) == b"x"
        # Served under the name "localhost" too (the certificate names both).
        target = f"localhost:{server.port}"
        assert _secure_call(target, ClientTLS(ca=str(tls.ca.cert_path))) == b"x"
        _refused(lambda: _secure_call(server.target, ClientTLS(ca=str(tls.other_ca.cert_path))))
        with grpc.insecure_channel(server.target) as ch:
            _refused(lambda: call(ch, "Unary", timeout=3))
        assert len(server.seen) == 2


def test_a_server_certificate_from_another_ca_is_refused_by_the_client(tls):
    with _server(ServerTLS(str(tls.rogue_server.cert), str(tls.rogue_server.key))) as server:
        _refused(lambda: _secure_call(server.target, ClientTLS(ca=str(tls.ca.cert_path))))
        assert not server.seen


def test_mtls_requires_a_client_certificate_from_the_client_ca(tls):
    config = ServerTLS(str(tls.server.cert), str(tls.server.key), client_ca=str(tls.ca.cert_path))
    ca = str(tls.ca.cert_path)
    with _server(config) as server:
        ok = ClientTLS(ca=ca, cert=str(tls.client.cert), key=str(tls.client.key))
        assert _secure_call(server.target, ok) == b"x"
        _refused(lambda: _secure_call(server.target, ClientTLS(ca=ca)))
        rogue = ClientTLS(ca=ca, cert=str(tls.rogue_client.cert), key=str(tls.rogue_client.key))
        _refused(lambda: _secure_call(server.target, rogue))
        assert len(server.seen) == 1


def test_half_configurations_and_bad_files_fail_at_start(tls, tmp_path):
    assert server_tls_from_args(None, None, None) is None
    assert client_tls_from_args(None, None, None) is None
    with pytest.raises(ValueError, match="go together"):
        server_tls_from_args(str(tls.server.cert), None, None)
    with pytest.raises(ValueError, match="needs --tls-cert"):
        server_tls_from_args(None, None, str(tls.ca.cert_path))
    with pytest.raises(ValueError, match="go together"):
        client_tls_from_args(str(tls.ca.cert_path), str(tls.client.cert), None)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="not PEM"):
        server_tls_from_args(str(junk), str(tls.server.key), None)
    with pytest.raises(ValueError, match="cannot read"):
        server_tls_from_args(str(tmp_path / "missing.pem"), str(tls.server.key), None)
    assert server_tls_from_args(str(tls.server.cert), str(tls.server.key), str(tls.ca.cert_path)).client_ca
