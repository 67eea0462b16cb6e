"""API keys: the key file, the bearer header, and the interceptor on every RPC kind (real server)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.auth import ANONYMOUS, ApiKeys, Authenticator, AuthInterceptor, bearer_token
from tests.grpc_echo import KINDS, EchoServer, call, health_check

KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-bravo-0123456789abcdef"


def _keys_file(tmp_path, text: str):
    p = tmp_path / "keys"
    p.write_text(text)
    p.chmod(0o600)
    return p


def test_key_file_names_tenants_skips_comments_and_derives_a_name_for_a_bare_key(tmp_path):
    keys = ApiKeys.from_file(_keys_file(tmp_path, f"# tenants\nacme {KEY_A}\n\n  {KEY_B}  \n"))
    assert len(keys) == 2
    assert keys.identify(KEY_A).tenant == "acme"
    bare = keys.identify(KEY_B).tenant
    assert bare.startswith("key-") and KEY_B not in bare  # the name never spells the key
    assert keys.identify("sk-nobody-0123456789abcdef") is None
    assert keys.identify("") is None
    assert keys.identify(KEY_A + "x") is None
    assert keys.identify(KEY_A[:-1]) is None


@pytest.mark.parametrize(
    "text, error",
    [
        ("acme short\n", "shorter than"),
        (f"a {KEY_A}\nb {KEY_A}\n", "listed twice"),
        (f"a {KEY_A} extra\n", "expected"),
        ("# nothing\n", "no API keys"),
    ],
)
def test_bad_key_files_are_refused_at_start(tmp_path, text, error):
    with pytest.raises(ValueError, match=error):
        ApiKeys.from_file(_keys_file(tmp_path, text))


def test_bearer_token_parsing():
    assert bearer_token([("authorization", f"Bearer {KEY_A}")]) == KEY_A
    assert bearer_token([("authorization", f"bearer   {KEY_A} ")]) == KEY_A
    assert bearer_token([("Authorization", f"Bearer {KEY_A}".encode())]) == KEY_A
    assert bearer_token([("authorization", f"Basic {KEY_A}")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token([("x-api-key", KEY_A)]) is None
    assert bearer_token(None) is None


def test_without_keys_everyone_is_the_anonymous_tenant():
    auth = Authenticator(None)
    assert not auth.enabled
    assert auth.identify([]) is ANONYMOUS
    assert ANONYMOUS.cache_salt == ""
    tenant = Authenticator(ApiKeys([("t", KEY_A)])).identify([("authorization", f"Bearer {KEY_A}")])
    assert tenant.cache_salt == "tenant:t"


@pytest.fixture
def guarded():
    auth = Authenticator(ApiKeys([("acme", KEY_A), ("globex", KEY_B)]))
    denied: list[str] = []
    with EchoServer(interceptors=[AuthInterceptor(auth, on_denied=denied.append)]) as server:
        server.auth, server.denied = auth, denied
        yield server


@pytest.mark.parametrize("kind", KINDS)
def test_every_rpc_kind_refuses_a_missing_or_wrong_key_and_admits_a_right_one(guarded, kind):
    with grpc.insecure_channel(guarded.target) as ch:
        for metadata in (
            None,
            [("authorization", "Bearer sk-wrong-0123456789abcdef")],
            [("authorization", KEY_A)],  # no scheme
            [("x-api-key", KEY_A)],
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(ch, kind, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert not guarded.seen, "a handler ran for an unauthenticated call"
        assert len(guarded.denied) == 4
        out = call(ch, kind, b"ok", metadata=[("authorization", f"Bearer {KEY_B}")])
        assert out in (b"ok", b"okok", [b"ok"] * 3, [b"ok"] * 2)
        (seen_kind, metadata) = guarded.seen[-1]
        assert seen_kind == kind
        assert guarded.auth.identify(metadata).tenant == "globex"


def test_health_is_exempt_and_garbage_from_an_unknown_caller_is_not_parsed(guarded):
    with grpc.insecure_channel(guarded.target) as ch:
        assert health_check(ch) == health_pb2.HealthCheckResponse.SERVING
        # Bytes that are no valid HealthCheckRequest would fail to parse; the refusal comes first.
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/llmserve.v1.Generation/Generate")(b"\xff\xfe garbage", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_takes_anthropics_x_api_key_where_no_bearer_is_sent():
    auth = Authenticator(ApiKeys([("acme", KEY_A), ("globex", KEY_B)]))
    assert auth.identify_http([("x-api-key", KEY_A)]).tenant == "acme"
    assert auth.identify_http([("X-Api-Key", f" {KEY_B} ")]).tenant == "globex"
    assert auth.identify_http([("x-api-key", "sk-wrong-0123456789abcdef")]) is None
    assert auth.identify_http([]) is None
    # A bearer token decides where one is sent (a wrong one is not rescued by the other header).
    assert (
        auth.identify_http([("authorization", "Bearer sk-wrong-0123456789abcdef"), ("x-api-key", KEY_A)])
        is None
    )
    assert auth.identify([("x-api-key", KEY_A)]) is None  # gRPC: bearer only
    assert Authenticator(None).identify_http([]) is ANONYMOUS
