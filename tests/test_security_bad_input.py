"""Bad input against a real service: Hypothesis over every GenerateRequest field, the configured
limits, duplicate ids, garbage on the wire, an oversized message. Each gets its status code (with
field violations where the fault is a field), the engine never sees an invalid request, and the
service keeps serving."""

from __future__ import annotations

import math
import socket
import time

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.client import LLMServeClient
from gateway.errors import field_violations
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from tests.fault_helpers import (
    assert_engine_clean,
    assert_segments_only_of_live_sessions,
    ends_clean,  # noqa: F401  (autouse fixture: importing it applies it here)
    stop_and_check,
)
from tests.service_process import ServiceProcess

VOCAB = 1024
LIMITS = dict(n=4, max_tokens=64, stop=2, stop_chars=8, logprobs=3, prompt_tokens=200, prompt_chars=2000)
MAX_MESSAGE = 65536


@pytest.fixture(scope="module")
def svc(tiny_llama):
    sp = ServiceProcess(
        tiny_llama,
        "--num-kv-blocks",
        "256",
        "--tokenizer-workers",
        "1",
        "--max-n",
        str(LIMITS["n"]),
        "--max-tokens-limit",
        str(LIMITS["max_tokens"]),
        "--max-stop-strings",
        str(LIMITS["stop"]),
        "--max-stop-string-chars",
        str(LIMITS["stop_chars"]),
        "--max-logprobs",
        str(LIMITS["logprobs"]),
        "--max-prompt-tokens",
        str(LIMITS["prompt_tokens"]),
        "--max-prompt-chars",
        str(LIMITS["prompt_chars"]),
        "--max-message-bytes",
        str(MAX_MESSAGE),
        "--keepalive-time-s",
        "0.2",
        "--keepalive-timeout-s",
        "5",
    ).start()
    try:
        yield sp
        stop_and_check(sp)
    finally:
        sp.kill()


@pytest.fixture(scope="module")
def client(svc):
    with LLMServeClient(svc.target, timeout=30) as c:
        yield c


# --- Hypothesis over the proto fields --------------------------------------------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
ODD_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-45, 3.4e38, -3.4e38, math.nan, math.inf, -math.inf]),
)
TOKEN = st.one_of(st.integers(0, VOCAB - 1), INT32)
TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=200),
    st.just(""),
    st.just("x" * (LIMITS["prompt_chars"] + 1)),
)


@st.composite
def generate_requests(draw) -> gen.GenerateRequest:
    """Mostly sensible requests with a few odd fields each, so that both the refusals and the
    requests that reach the engine are explored."""

    def pick(sane, odd):
        return draw(odd if draw(st.integers(0, 6)) == 0 else sane)

    req = gen.GenerateRequest()
    kind = draw(st.sampled_from(["text", "text", "token_ids", "chat", "none"]))
    if kind == "text":
        req.text = pick(st.text(min_size=1, max_size=40), TEXT)
    elif kind == "token_ids":
        ids = pick(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
            st.one_of(st.lists(TOKEN, max_size=20), st.just([5] * (LIMITS["prompt_tokens"] + 1))),
        )
        req.token_ids.ids.extend(ids)
    elif kind == "chat":
        roles = pick(
            st.sampled_from(["user", "assistant", "system"]), st.sampled_from(["", "tool", "\x00", "user"])
        )
        for content in draw(
            st.lists(st.text(max_size=30), min_size=pick(st.just(1), st.just(0)), max_size=3)
        ):
            req.chat.messages.add(role=roles, content=content)
    if draw(st.booleans()):
        req.request_id = pick(st.uuids().map(str), st.one_of(st.text(max_size=20), st.just("r" * 300)))
    sane_floats = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "min_p": st.floats(0, 1),
        "repetition_penalty": st.floats(0.5, 2),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
    }
    for name, sane in sane_floats.items():
        if draw(st.booleans()):
            setattr(req, name, pick(sane, ODD_FLOATS))
    if draw(st.booleans()):
        req.top_k = pick(st.integers(-1, 50), st.one_of(st.integers(-3, 5), INT32))
    if draw(st.booleans()):
        req.seed = draw(st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        req.n = pick(st.integers(1, LIMITS["n"]), UINT32)
    req.max_tokens = pick(st.integers(1, 4), UINT32)  # small, so that the valid ones are quick
    if draw(st.booleans()):
        req.min_tokens = pick(st.integers(0, 2), UINT32)
    req.stop.extend(
        pick(
            st.lists(st.text(min_size=1, max_size=4), max_size=2), st.lists(st.text(max_size=12), max_size=4)
        )
    )
    req.stop_token_ids.extend(
        pick(st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(TOKEN, max_size=4))
    )
    if draw(st.booleans()):
        req.logprobs = pick(st.integers(0, LIMITS["logprobs"]), UINT32)
    if draw(st.booleans()):
        req.prompt_logprobs = pick(st.integers(0, LIMITS["logprobs"]), UINT32)
    req.priority = pick(st.just(0), INT32)
    req.ignore_eos = draw(st.booleans())
    req.return_token_ids = True
    return req


def clearly_invalid(req: gen.GenerateRequest) -> list[str]:
    """Rules a client can check by reading the API: a request breaking one must be refused."""
    out = []
    kind = req.WhichOneof("prompt")
    if kind is None:
        out.append("prompt")
    elif kind == "text" and (not req.text or len(req.text) > LIMITS["prompt_chars"]):
        out.append("text")
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids or len(ids) > LIMITS["prompt_tokens"] or any(not 0 <= t < VOCAB for t in ids):
            out.append("token_ids")
    elif kind == "chat" and (not req.chat.messages or any(not m.role for m in req.chat.messages)):
        out.append("chat")
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if req.HasField(name) and not math.isfinite(getattr(req, name)):
            out.append(name)
    if req.HasField("temperature") and req.temperature < 0:
        out.append("temperature")
    if req.HasField("top_p") and not 0 < req.top_p <= 1:
        out.append("top_p")
    if req.HasField("top_k") and (req.top_k < -1 or req.top_k > VOCAB):
        out.append("top_k")
    if req.HasField("n") and not 1 <= req.n <= LIMITS["n"]:
        out.append("n")
    if not 1 <= req.max_tokens <= LIMITS["max_tokens"]:
        out.append("max_tokens")
    if len(req.stop) > LIMITS["stop"] or any(not s or len(s) > LIMITS["stop_chars"] for s in req.stop):
        out.append("stop")
    if any(not 0 <= t < VOCAB for t in req.stop_token_ids):
        out.append("stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        if req.HasField(name) and getattr(req, name) > LIMITS["logprobs"]:
            out.append(name)
    if len(req.request_id) > 256 or any(not c.isprintable() for c in req.request_id):
        out.append("request_id")
    return out


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=generate_requests())
def test_any_generate_request_gets_ok_or_invalid_argument_with_field_violations(client, req):
    try:
        out = client.generation.Generate(req, timeout=30)  # the message exactly as drawn
    except grpc.RpcError as e:
        event(e.code().name)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), req)
        assert field_violations(e), e.details()
        return
    event("OK")
    assert not clearly_invalid(req), (clearly_invalid(req), req)
    assert out.finish_reason in (gen.FINISH_REASON_STOP, gen.FINISH_REASON_LENGTH)
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_after_the_fuzzing_the_engine_saw_no_invalid_request_and_is_clean(svc, client):
    assert svc.engine_stats().num_refused_submits == 0
    assert client.generate("still serving", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    assert_engine_clean(svc)
    assert_segments_only_of_live_sessions(svc)


# --- limits, named in the error ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field, limit",
    [
        (dict(prompt="hi", n=LIMITS["n"] + 1), "n", LIMITS["n"]),
        (dict(prompt="hi", max_tokens=LIMITS["max_tokens"] + 1), "max_tokens", LIMITS["max_tokens"]),
        (dict(prompt="hi", stop=["a", "b", "c"]), "stop", LIMITS["stop"]),
        (dict(prompt="hi", stop=["x" * 9]), "stop[0]", LIMITS["stop_chars"]),
        (dict(prompt="hi", logprobs=LIMITS["logprobs"] + 1), "logprobs", LIMITS["logprobs"]),
        (dict(token_ids=[5] * 201), "token_ids.ids", LIMITS["prompt_tokens"]),
        (dict(prompt="y" * 2001), "text", LIMITS["prompt_chars"]),
        (dict(prompt="word " * 300), "text", LIMITS["prompt_tokens"]),  # counted after tokenizing
    ],
)
def test_each_limit_is_refused_naming_the_field_and_the_limit(client, kwargs, field, limit):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(**{"max_tokens": 2, **kwargs})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = field_violations(e.value)
    assert [v.field for v in violations] == [field]
    assert str(limit) in violations[0].description


def test_model_info_reports_the_limits_enforced(client):
    lim = client.model_info().limits
    assert (lim.max_n, lim.max_tokens, lim.max_stop_strings, lim.max_stop_string_chars) == (
        LIMITS["n"],
        LIMITS["max_tokens"],
        LIMITS["stop"],
        LIMITS["stop_chars"],
    )
    assert (lim.max_logprobs, lim.max_prompt_tokens, lim.max_prompt_chars) == (
        LIMITS["logprobs"],
        LIMITS["prompt_tokens"],
        LIMITS["prompt_chars"],
    )


# --- ids, bytes, sizes, sockets ---------------------------------------------------------------------


def test_a_duplicate_request_id_in_flight_is_refused_and_the_first_completes(client):
    first = client.generate_stream("dup", request_id="same-id", max_tokens=60, ignore_eos=True)
    assert next(iter(first)).request_id == "same-id"
    with pytest.raises(grpc.RpcError) as e:
        client.generate("dup again", request_id="same-id", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert [v.field for v in field_violations(e.value)] == ["request_id"]
    assert list(first)[-1].usage.completion_tokens == 60


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Tokenize", "Detokenize"])
def test_garbage_bytes_are_invalid_argument(svc, method):
    with grpc.insecure_channel(svc.target) as ch:
        path = f"/llmserve.v1.Generation/{method}"
        call = ch.unary_stream(path) if method == "GenerateStream" else ch.unary_unary(path)
        for payload in (b"\xff\xfe\xfd garbage", b"\x1a\xff\xff\xff\xff\x0f", b"\x0a\x05ab"):
            with pytest.raises(grpc.RpcError) as e:
                result = call(payload, timeout=5)
                if method == "GenerateStream":
                    list(result)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload)


def test_a_message_over_the_size_limit_is_resource_exhausted(client):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(token_ids=[1000] * MAX_MESSAGE, max_tokens=1)  # 2 bytes per id on the wire
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:
        client.detokenize([1000] * MAX_MESSAGE)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_non_grpc_bytes_on_the_socket_are_dropped_and_the_service_goes_on(svc, client):
    for junk in (
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00" + bytes(300),
        bytes(range(256)) * 8,
    ):
        with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except (ConnectionResetError, TimeoutError):
                pass
    assert client.generate("still here", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_keepalive_pings_do_not_break_a_stream_the_client_reads_slowly(client):
    """The server pings every 0.2s here; a stream paused by its reader for 1.5s lives on."""
    stream = client.generate_stream("slow reader", max_tokens=40, ignore_eos=True)
    first = next(iter(stream))
    time.sleep(1.5)
    rest = list(stream)
    assert first.text is not None and rest[-1].usage.completion_tokens == 40
