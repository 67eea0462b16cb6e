"""API keys, TLS and mTLS on the real service, tenant isolation in the prefix cache, and TLS on the
gateway-to-engine link over TCP."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine_svc.rpc.tls import ClientTLS
from gateway.client import LLMServeClient
from gateway.engine_client import EngineClient
from llmserve_proto.engine.v1 import engine_pb2, engine_pb2_grpc
from llmserve_proto.llmserve.v1 import adapters_pb2, adapters_pb2_grpc, models_pb2, models_pb2_grpc
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.fault_helpers import (
    assert_engine_clean,
    assert_segments_only_of_live_sessions,
    ends_clean,  # noqa: F401  (autouse fixture: importing it applies it here)
    stop_and_check,
    wait_for,
)
from tests.service_process import ServiceProcess
from tests.tls_certs import make_tls_material

ACME = "sk-acme-0123456789abcdef0123"
GLOBEX = "sk-globex-0123456789abcdef01"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def svc(tiny_llama, tls, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# tenant key\nacme {ACME}\nglobex {GLOBEX}\n")
    keys.chmod(0o600)
    sp = ServiceProcess(
        tiny_llama,
        "--num-kv-blocks",
        "256",
        "--tokenizer-workers",
        "1",
        "--api-key-file",
        str(keys),
        "--tls-cert",
        str(tls.server.cert),
        "--tls-key",
        str(tls.server.key),
        "--tls-client-ca",
        str(tls.ca.cert_path),
        "--http-port",
        "0",
    ).start()
    try:
        yield sp
        stop_and_check(sp)
    finally:
        sp.kill()


def _tls(tls, cert=None, ca=None) -> ClientTLS:
    cert = cert or tls.client
    return ClientTLS(ca=str(ca or tls.ca.cert_path), cert=str(cert.cert), key=str(cert.key))


def _client(svc, tls, key=None, **kw) -> LLMServeClient:
    return LLMServeClient(svc.target, timeout=30, api_key=key, tls=_tls(tls, **kw))


def _every_rpc(ch: grpc.Channel, metadata) -> dict[str, grpc.StatusCode]:
    """Call each public RPC once (unary and streaming); the status each one ended with."""
    g, m = gen_grpc.GenerationStub(ch), models_pb2_grpc.ModelsStub(ch)
    r = reflection_pb2_grpc.ServerReflectionStub(ch)
    a = adapters_pb2_grpc.AdaptersStub(ch)
    calls = {
        # The admin API: LoRA is off here, so with a key the list is empty (OK).
        "ListAdapters": lambda: a.ListAdapters(
            adapters_pb2.ListAdaptersRequest(), metadata=metadata, timeout=10
        ),
        "Generate": lambda: g.Generate(
            gen.GenerateRequest(text="hi", max_tokens=2), metadata=metadata, timeout=10
        ),
        "GenerateStream": lambda: list(
            g.GenerateStream(gen.GenerateRequest(text="hi", max_tokens=2), metadata=metadata, timeout=10)
        ),
        "Tokenize": lambda: g.Tokenize(gen.TokenizeRequest(text="hi"), metadata=metadata, timeout=10),
        "Detokenize": lambda: g.Detokenize(
            gen.DetokenizeRequest(token_ids=[5]), metadata=metadata, timeout=10
        ),
        "ListModels": lambda: m.ListModels(models_pb2.ListModelsRequest(), metadata=metadata, timeout=10),
        "GetModelInfo": lambda: m.GetModelInfo(
            models_pb2.GetModelInfoRequest(), metadata=metadata, timeout=10
        ),
        "Reflection": lambda: list(
            r.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=metadata,
                timeout=10,
            )
        ),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out[name] = e.code()
    return out


def test_every_rpc_kind_needs_a_valid_key_and_health_does_not(svc, tls):
    with _client(svc, tls) as c:
        for metadata in (
            None,
            [("authorization", "Bearer sk-wrong-0123456789abcdef")],
            [("authorization", ACME)],
        ):
            codes = _every_rpc(c.channel, metadata)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (metadata, codes)
        assert set(_every_rpc(c.channel, [("authorization", f"Bearer {ACME}")]).values()) == {
            grpc.StatusCode.OK
        }
        health = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "api_keys=2" in svc.log_tail(100000) and ACME not in svc.log_tail(100000)


@pytest.mark.parametrize(
    "how", ["plaintext", "no client certificate", "client cert of another CA", "wrong CA"]
)
def test_tls_refuses_plaintext_and_foreign_or_missing_client_certificates(svc, tls, how):
    if how == "plaintext":
        channel = grpc.insecure_channel(svc.target)
    else:
        creds = {
            "no client certificate": ClientTLS(ca=str(tls.ca.cert_path)),
            "client cert of another CA": _tls(tls, cert=tls.rogue_client),
            "wrong CA": _tls(tls, ca=tls.other_ca.cert_path),
        }[how]
        channel = grpc.secure_channel(svc.target, creds.credentials())
    with LLMServeClient(svc.target, timeout=5, channel=channel, api_key=ACME) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate("hi", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):
            c.health_status()


def test_tenants_never_share_prefix_cache_blocks_but_one_tenant_does(svc, tls):
    prompt = list(range(100, 164))  # four full blocks of 16
    opts = dict(token_ids=prompt, max_tokens=2, ignore_eos=True)
    with _client(svc, tls, key=ACME) as acme, _client(svc, tls, key=GLOBEX) as globex:
        assert acme.generate(**opts).usage.cached_prompt_tokens == 0
        # its own blocks: three whole, and 15 of the fourth's 16 (the last token is always computed)
        assert acme.generate(**opts).usage.cached_prompt_tokens == 63
        assert globex.generate(**opts).usage.cached_prompt_tokens == 0  # never acme's
        assert globex.generate(**opts).usage.cached_prompt_tokens == 63
    assert_engine_clean(svc)
    assert_segments_only_of_live_sessions(svc)


# --- the gateway-to-engine link over TCP with mTLS ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls_engine(tiny_llama, tls):
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine_svc.server",
            "--model",
            str(tiny_llama),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-kv-blocks",
            "128",
            "--tls-cert",
            str(tls.server.cert),
            "--tls-key",
            str(tls.server.key),
            "--tls-client-ca",
            str(tls.ca.cert_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_gateway_reaches_a_tcp_engine_over_mtls_and_plaintext_or_no_cert_cannot(tiny_llama, tls, tls_engine):
    address, engine = tls_engine
    sp = ServiceProcess(
        tiny_llama,
        "--engine",
        address,
        "--tokenizer-workers",
        "0",
        "--engine-tls-ca",
        str(tls.ca.cert_path),
        "--engine-tls-cert",
        str(tls.client.cert),
        "--engine-tls-key",
        str(tls.client.key),
    ).start()
    try:
        with LLMServeClient(sp.target, timeout=30) as c:
            out = c.generate("over mTLS", max_tokens=4, ignore_eos=True)
            assert out.usage.completion_tokens == 4
        with grpc.secure_channel(address, _tls(tls).credentials()) as ch:
            st = engine_pb2_grpc.EngineStub(ch).GetStats(
                engine_pb2.GetStatsRequest(check_invariants=True), timeout=10
            )
        assert not st.invariant_error and st.load.kv_blocks_used == 0 and st.num_live_requests == 0
        stop_and_check(sp)
    finally:
        sp.kill()

    async def cannot_connect(tls_config) -> bool:
        client = EngineClient(address, use_shared_memory=False, tls=tls_config, heartbeat_timeout_s=0.5)
        await client.start()
        try:
            await client.wait_ready(timeout=3.0)
            return False
        except TimeoutError:
            return True
        finally:
            await client.close()

    assert asyncio.run(cannot_connect(None))  # plaintext
    assert asyncio.run(cannot_connect(ClientTLS(ca=str(tls.ca.cert_path))))  # no client certificate
    assert asyncio.run(cannot_connect(_tls(tls, cert=tls.rogue_client)))  # a certificate of another CA
    wait_for(lambda: engine.poll() is None, 1.0, "the engine is still up")


def test_http_api_takes_the_same_tls_and_keys(svc, tls):
    """The OpenAI-compatible port serves the same TLS (mTLS here) and the same API keys."""
    import ssl

    import httpx

    url = f"https://127.0.0.1:{svc.http_port}"
    ctx = ssl.create_default_context(cafile=str(tls.ca.cert_path))
    ctx.load_cert_chain(str(tls.client.cert), str(tls.client.key))
    body = {"prompt": "hello", "max_tokens": 2}
    with httpx.Client(verify=ctx, timeout=30) as c:
        ok = c.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {ACME}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        denied = c.post(
            url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-not-a-key-0000000"}
        )
        assert denied.status_code == 401
    no_cert = ssl.create_default_context(cafile=str(tls.ca.cert_path))
    with pytest.raises(httpx.TransportError), httpx.Client(verify=no_cert, timeout=10) as c:
        c.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {ACME}"})
    with pytest.raises(httpx.TransportError), httpx.Client(timeout=10) as c:
        c.post(f"http://127.0.0.1:{svc.http_port}/v1/completions", json=body)
