"""The OpenAI-compatible HTTP API end to end: a real ``llmserve serve --http-port`` and the real
``openai`` client (sync and async), raw SSE through httpx, and Node.js ``fetch``.

One service (module scope, with API keys and small admission limits) serves every test here.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from gateway.client import LLMServeClient
from tests.fault_helpers import assert_engine_clean, wait_for
from tests.service_process import ServiceProcess

KEY = "sk-http-test-key-0123456789"
OTHER = "sk-http-other-key-9876543210"
NODE_DIR = Path(__file__).resolve().parent / "node"
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def service(default_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"acme {KEY}\nglobex {OTHER}\n")
    keys.chmod(0o600)
    args = [
        "--num-kv-blocks",
        "1024",
        "--http-port",
        "0",
        "--api-key-file",
        str(keys),
        "--served-model-name",
        "default",
    ]
    args += ["--max-concurrent", "3", "--max-queue", "0", "--max-message-bytes", str(1 << 20)]
    args += ["--stream-stall-timeout", "2", "--drain-grace-s", "1"]
    with ServiceProcess(default_model_dir, *args) as sp:
        assert sp.http_port
        yield sp


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(service):
    with LLMServeClient(service.target, timeout=60, api_key=KEY) as c:
        yield c


def test_completion_equals_grpc_greedy_tokens(client, grpc_client, service):
    r = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    want = grpc_client.generate(PROMPT, max_tokens=12, temperature=0.0, return_token_ids=True)
    choice = r.choices[0]
    assert choice.token_ids == list(want.token_ids)  # vLLM's extra field, passed through by the SDK
    assert choice.text == want.text
    assert choice.finish_reason in ("length", "stop")
    assert r.object == "text_completion" and r.model == "default"
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # token ids as the prompt give the same output
    ids = grpc_client.tokenize(PROMPT)
    r2 = client.completions.create(model="default", prompt=ids, max_tokens=12, temperature=0)
    assert r2.choices[0].text == want.text


def test_chat_streamed_and_not_agree_with_grpc(client, grpc_client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there 🎉"}]
    whole = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    want = grpc_client.generate(messages=messages, max_tokens=10, temperature=0.0, return_token_ids=True)
    assert whole.choices[0].token_ids == list(want.token_ids)
    assert whole.choices[0].message.content == want.text
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"


def test_n_logprobs_and_seed_repeatability(client):
    kwargs = dict(model="default", prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7, logprobs=3)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    for c in a.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(len(t) == 3 for t in lp.top_logprobs)
        assert "".join(lp.tokens) == c.text
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_stop_string_ends_the_text(client):
    base = client.completions.create(model="default", prompt=PROMPT, max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[3:6]
    assert stop and stop not in text[:3]
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop


def test_several_prompts_streamed_and_not(client):
    prompts = ["Once upon a time", "In a galaxy far away"]
    whole = client.completions.create(model="default", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model="default", prompt=prompts, max_tokens=6, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    # token ids and text mixed, n = 2 each: choice index = prompt * n + sequence
    mixed = client.completions.create(
        model="default", prompt=[[1, 2, 3], "Once upon a time"], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in mixed.choices] == [0, 1, 2, 3]
    assert (
        mixed.choices[2].text == mixed.choices[3].text == whole.choices[0].text[: len(mixed.choices[2].text)]
    )


def test_several_prompts_streamed_disconnect_frees_all(service):
    body = {"prompt": [PROMPT, "Once upon a time"], "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", service.http_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert service.engine_stats().num_live_requests == 2
        lines.close()
    assert_engine_clean(service)


def test_prompt_logprobs_and_json_object(client):
    r = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    plps = r.choices[0].model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == r.usage.prompt_tokens
    chat = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if chat.choices[0].finish_reason == "stop":  # else cut by max_tokens: a valid prefix only
        json.loads(chat.choices[0].message.content)
    assert chat.choices[0].message.content.lstrip()[:1] in ("{", "[", '"', "-", "t", "f", "n", *"0123456789")


def test_async_client_streams(service):
    async def main():
        c = openai.AsyncOpenAI(base_url=service.http_url + "/v1", api_key=KEY, max_retries=0)
        prompts = ["Hello", "Tell me a story", "1 2 3"]

        async def one(p):
            text = ""
            stream = await c.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": p}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
            whole = await c.chat.completions.create(
                model="default", messages=[{"role": "user", "content": p}], max_tokens=8, temperature=0
            )
            return text, whole.choices[0].message.content

        out = await asyncio.gather(*(one(p) for p in prompts))
        await c.close()
        return out

    for streamed, whole in asyncio.run(main()):
        assert streamed == whole


def test_response_format_json_object(client):
    r = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}},
    )
    assert json.loads(r.choices[0].message.content) in (True, False)


def _error(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_errors_have_openai_shape_and_status(client, service):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=-1)
    err = _error(e.value)
    assert (
        e.value.status_code == 400
        and err["param"] == "temperature"
        and err["type"] == "invalid_request_error"
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=PROMPT, max_tokens=4, extra_body={"top_k": "x"})
    assert _error(e.value)["param"] == "top_k"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert _error(e.value)["code"] == "not_found"
    # unknown fields are ignored, as vLLM does
    r = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=2, extra_body={"no_such_field": 1}
    )
    assert r.choices[0].text is not None
    # a body over --max-message-bytes
    big = httpx.post(
        service.http_url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        content=json.dumps({"prompt": "x" * (1 << 20), "max_tokens": 1}),
    )
    assert big.status_code == 413 and "max_message_bytes" in big.json()["error"]["message"]
    # not JSON
    bad = httpx.post(
        service.http_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, content=b"{"
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"


def test_auth(service):
    c = openai.OpenAI(base_url=service.http_url + "/v1", api_key="sk-wrong-key-000000000000", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(model="default", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401 and _error(e.value)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    raw = httpx.post(service.http_url + "/v1/chat/completions", json={"messages": []})
    assert raw.status_code == 401 and raw.json()["error"]["code"] == "unauthenticated"
    raw = httpx.get(service.http_url + "/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert raw.status_code == 401
    assert httpx.get(service.http_url + "/health").status_code == 200  # exempt, like gRPC health
    c = openai.OpenAI(base_url=service.http_url + "/v1", api_key=OTHER, max_retries=0)
    assert [m.id for m in c.models.list()] == ["default"]


def test_tokenize_detokenize(service, grpc_client):
    h = {"Authorization": f"Bearer {KEY}"}
    t = httpx.post(service.http_url + "/tokenize", headers=h, json={"prompt": PROMPT}).json()
    assert t["tokens"] == grpc_client.tokenize(PROMPT) and t["count"] == len(t["tokens"])
    d = httpx.post(service.http_url + "/detokenize", headers=h, json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == PROMPT
    chat = httpx.post(
        service.http_url + "/tokenize", headers=h, json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] > 2


def _sse_events(response: httpx.Response) -> list[str]:
    raw = b"".join(response.iter_raw()).decode()
    assert raw.endswith("\n\n")
    return raw[:-2].split("\n\n")


def test_sse_framing_raw(service):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream(
        "POST", service.http_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 6
    assert sum(1 for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]) == 1
    # an error before any output is a plain JSON error, not a stream
    body["temperature"] = -1
    with httpx.stream(
        "POST", service.http_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        r.read()
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def _long_stream(service, request_id: str | None = None):
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    if request_id:
        body["request_id"] = request_id
    client = httpx.Client(timeout=30)
    cm = client.stream(
        "POST", service.http_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    r = cm.__enter__()
    lines = r.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"]

    def close():  # holds `lines`: a collected iterator would close the connection (httpcore)
        lines.close()
        cm.__exit__(None, None, None)
        client.close()

    return close


def test_client_disconnect_frees_the_engine_blocks(service):
    close = _long_stream(service, request_id="disconnects")
    assert service.engine_stats().num_live_requests == 1  # running, or paused: this client reads slowly
    close()
    assert_engine_clean(service)
    # Ended by the disconnect: not by its 2000 tokens, nor by the stall timeout.
    finished = re.compile(r'request_id=disconnects\S* finished outcome="(\w+)"')
    outcome = wait_for(lambda: finished.search(service.log_tail(200000)), 30, "no 'finished' line")
    assert outcome.group(1) == "cancelled", outcome.group(0)


def test_non_streamed_disconnect_aborts_too(service):
    def post():
        try:
            httpx.post(
                service.http_url + "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=1.0,
            )
        except httpx.TimeoutException:
            pass  # the client gives up after 1 s and closes the connection

    t = threading.Thread(target=post)
    t.start()
    t.join()
    assert_engine_clean(service)


def test_conflict_and_admission_limits(service, client):
    closers = [_long_stream(service, request_id="dup")]
    try:
        with pytest.raises(openai.ConflictError) as e:
            client.completions.create(
                model="default", prompt=PROMPT, max_tokens=2, extra_body={"request_id": "dup"}
            )
        assert _error(e.value)["code"] == "already_exists"
        closers += [_long_stream(service), _long_stream(service)]  # 3 running: --max-concurrent 3, queue 0
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="default", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert _error(e.value)["type"] == "rate_limit_error"
    finally:
        for close in closers:
            close()
    assert_engine_clean(service)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_fetch_streams_the_same_text(service, grpc_client):
    out = subprocess.run(
        ["node", str(NODE_DIR / "openai_fetch.js"), service.http_url, KEY, PROMPT, "12"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    want = grpc_client.generate(PROMPT, max_tokens=12, temperature=0.0)
    assert result["text"] == want.text
    assert result["done"] and result["events"] >= 2


def test_a_client_that_stops_reading_is_paused_then_ended(service):
    """The gRPC path's backpressure, over HTTP: uvicorn's writes wait on the full socket, the request
    is paused in the engine, and the stall sweep ends it (--stream-stall-timeout 2)."""
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": 1500, "n": 8, "stream": True, "ignore_eos": True, "logprobs": 20}
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window; then read nothing
    sock.connect(("127.0.0.1", service.http_port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    try:
        # The kernel's buffers take megabytes first (about 10 s here); the bound is for a hang.
        wait_for(
            lambda: 'outcome="stalled"' in service.log_tail(20000), 120, "the stalled stream was not ended"
        )
        assert service.engine_stats().load.num_steps  # the engine is alive
        assert_engine_clean(service)
    finally:
        sock.close()


def test_unset_max_tokens_is_the_rest_of_the_context(client, grpc_client):
    """vLLM's rule: no max_tokens = max_model_len - prompt (the gRPC default, 16, would not fit)."""
    max_len = grpc_client.model_info().max_model_len
    prompt = [(7 * i) % 500 + 3 for i in range(max_len - 3)]
    r = client.completions.create(
        model="default", prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    with pytest.raises(grpc.RpcError) as e:  # the gRPC API keeps its documented default
        grpc_client.generate(token_ids=prompt, temperature=0.0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_prompt_token_ids_with_return_token_ids(client, grpc_client):
    ids = grpc_client.tokenize(PROMPT)
    extra = {"return_token_ids": True}
    r = client.completions.create(
        model="default", prompt=[PROMPT, ids[:5]], max_tokens=3, temperature=0, extra_body=extra
    )
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == [ids, ids[:5]]
    chunks = list(
        client.completions.create(
            model="default", prompt=PROMPT, max_tokens=3, temperature=0, extra_body=extra, stream=True
        )
    )
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks if c.choices]
    assert firsts[0] == ids and not any(firsts[1:])
    messages = [{"role": "user", "content": "Hello"}]
    want = grpc_client.tokenize(messages=messages)
    chat = client.chat.completions.create(
        model="default", messages=messages, max_tokens=3, temperature=0, extra_body=extra
    )
    assert chat.model_extra["prompt_token_ids"] == want
    stream = list(
        client.chat.completions.create(
            model="default", messages=messages, max_tokens=3, temperature=0, extra_body=extra, stream=True
        )
    )
    assert stream[0].model_extra["prompt_token_ids"] == want
    plain = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, temperature=0)
    assert "prompt_token_ids" not in (plain.choices[0].model_extra or {})


def test_sigterm_drains_http_streams_last(service):
    """Runs last: SIGTERM ends an open HTTP stream after --drain-grace-s with finish_reason abort,
    then [DONE]; new requests meanwhile get 503; the process exits 0."""
    body = {"prompt": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", service.http_url + "/v1/completions", json=body, headers=h, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        service.proc.send_signal(15)
        # Draining (health says so at once) lasts the --drain-grace-s second at least: within it,
        wait_for(lambda: httpx.get(service.http_url + "/health").status_code == 503, 30, "no drain")
        refused = httpx.post(service.http_url + "/v1/completions", json={"prompt": "x"}, headers=h)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals[-1] == "abort"
    assert service.proc.wait(30) == 0
