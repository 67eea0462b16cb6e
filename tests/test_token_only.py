"""Token-only serving end to end: ``llmserve serve --skip-tokenizer-init`` on a model directory with
no tokenizer at all, over gRPC and the OpenAI HTTP API. Prompts are token ids, outputs token ids
(equal to the offline engine's greedy ids), and every field that needs text is refused with
INVALID_ARGUMENT / HTTP 400 naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import httpx
import pytest

from engine_svc.llm import LLM
from engine_svc.sampling_params import SamplingParams
from gateway.client import LLMServeClient
from gateway.errors import field_violations
from tests.service_process import ServiceProcess

PROMPT_IDS = [5, 17, 99, 300, 42, 7, 8, 250, 11, 64]


@pytest.fixture(scope="module")
def bare_model_dir(default_model_dir, tmp_path_factory):
    """The default model's weights and config, and no tokenizer file."""
    out = tmp_path_factory.mktemp("no_tokenizer")
    for f in default_model_dir.iterdir():
        if "tokenizer" not in f.name and f.name != "special_tokens_map.json" and f.is_file():
            shutil.copy(f, out / f.name)
    assert not list(out.glob("*token*"))
    return out


@pytest.fixture(scope="module")
def service(bare_model_dir):
    with ServiceProcess(bare_model_dir, "--skip-tokenizer-init", "--http-port", "0") as sp:
        yield sp


@pytest.fixture(scope="module")
def want_ids(bare_model_dir):
    with LLM(str(bare_model_dir), num_kv_blocks=64) as llm:
        assert llm.get_tokenizer() is None
        out = llm.generate([PROMPT_IDS], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_serve_without_tokenizer_fails_without_the_flag(bare_model_dir):
    with pytest.raises(RuntimeError, match="no tokenizer.json"):
        ServiceProcess(bare_model_dir, startup_timeout_s=120).start()


def test_no_tokenizer_workers(service):
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in service.descendants()]
    assert any(b"engine_svc.server" in c for c in commands)  # the reader sees the processes
    assert not [c for c in commands if b"tokenizer_svc.worker" in c]


def test_grpc_token_ids_in_and_out(service, want_ids):
    with LLMServeClient(service.target, timeout=60) as c:
        r = c.generate(token_ids=PROMPT_IDS, max_tokens=8, temperature=0.0)  # return_token_ids not asked
        assert list(r.token_ids) == want_ids and r.text == ""
        streamed = list(c.generate_stream(token_ids=PROMPT_IDS, max_tokens=8, temperature=0.0))
        assert [t for m in streamed for t in m.token_ids] == want_ids
        assert all(m.text == "" for m in streamed)
        assert not c.model_info().has_chat_template


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt="hello"), "text"),
        (dict(messages=[{"role": "user", "content": "hi"}]), "chat"),
        (dict(token_ids=PROMPT_IDS, stop=["x"]), "stop"),
        (dict(token_ids=PROMPT_IDS, bad_words=["x"]), "bad_words"),
        (dict(token_ids=PROMPT_IDS, json_object=True), "json_object"),
    ],
)
def test_grpc_refuses_text_fields(service, kwargs, field):
    with LLMServeClient(service.target, timeout=60) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(max_tokens=4, **kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(e.value)] == [field]
    assert "--skip-tokenizer-init" in e.value.details()


def test_grpc_tokenize_and_detokenize_refused(service):
    with LLMServeClient(service.target, timeout=60) as c:
        for call, field in ((lambda: c.tokenize("hi"), "text"), (lambda: c.detokenize([1, 2]), "token_ids")):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in field_violations(e.value)] == [field]


def test_http_completions_with_token_ids(service, want_ids):
    url = service.http_url
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "logprobs": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want_ids and choice["text"] == ""
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want_ids]  # vLLM's spelling
    # streamed: the ids arrive chunk by chunk
    ids = []
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={"prompt": [PROMPT_IDS], "max_tokens": 8, "temperature": 0, "stream": True},
        timeout=60,
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ids += httpx.Response(200, content=line[6:]).json()["choices"][0].get("token_ids", [])
    assert ids == want_ids


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "text"),
        ("/v1/completions", {"prompt": PROMPT_IDS, "stop": ["x"], "max_tokens": 2}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "hi"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/detokenize", {"tokens": [1, 2]}, "tokens"),
    ],
)
def test_http_refuses_text_fields(service, path, body, param):
    r = httpx.post(service.http_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "--skip-tokenizer-init" in err["message"]
