"""Every rule a request can break, once through each door: the OpenAI HTTP API (400, ``param``), the
gRPC API (INVALID_ARGUMENT, the first field violation) and the offline ``LLM`` (``InvalidRequest``,
its first violation). Each door must name the same field: the rules are written once
(engine_svc/request_limits.py, ``SamplingParams.violations``) and every door reads them. The
field names expected here are the ones a client writes, so the test is the client's reading, not
the validator's own table. A rule a door cannot express (a uint32 field cannot carry -1 over gRPC;
the offline engine has no server limits such as max_n) is read through the doors that can."""

from __future__ import annotations

import grpc
import httpx
import pytest

from engine_svc import LLM, SamplingParams
from gateway.client import LLMServeClient, build_request
from gateway.errors import field_violations
from tests.service_process import ServiceProcess

VOCAB, CONTEXT = 1024, 1024  # the tiny model's
KV_BLOCKS = 32  # of 16 tokens: a pool of 512 tokens, smaller than the context
MAX_N, MAX_STOP = 4, 2  # the server's limits (the offline engine has none)
ALL, SERVER = ("http", "grpc", "offline"), ("http", "grpc")
IDS_500 = [5] * 500
PROMPT_FIELD = {"http": "token_ids.ids", "grpc": "token_ids.ids", "offline": "prompt_token_ids"}

# (the rule, its fields as the client names them, the prompt, the field named, the doors)
CASES = [
    ("temperature below 0", dict(temperature=-1.0), "hi", "temperature", ALL),
    ("top_p of 0", dict(top_p=0.0), "hi", "top_p", ALL),
    ("min_p above 1", dict(min_p=1.5), "hi", "min_p", ALL),
    ("repetition_penalty of 0", dict(repetition_penalty=0.0), "hi", "repetition_penalty", ALL),
    ("presence_penalty above 2", dict(presence_penalty=3.0), "hi", "presence_penalty", ALL),
    ("frequency_penalty below -2", dict(frequency_penalty=-3.0), "hi", "frequency_penalty", ALL),
    ("top_k below -1", dict(top_k=-2), "hi", "top_k", ALL),
    ("top_k above the vocabulary", dict(top_k=VOCAB + 1), "hi", "top_k", ALL),
    ("n of 0", dict(n=0), "hi", "n", ALL),
    ("n above max_n", dict(n=MAX_N + 1), "hi", "n", SERVER),
    ("seed past int64", dict(seed=2**63), "hi", "seed", ("http", "offline")),
    ("max_tokens of 0", dict(max_tokens=0), "hi", "max_tokens", ALL),
    ("min_tokens above max_tokens", dict(min_tokens=5, max_tokens=3), "hi", "min_tokens", ALL),
    ("min_tokens below 0", dict(min_tokens=-1), "hi", "min_tokens", ("http", "offline")),
    ("an empty stop string", dict(stop=["ok", ""]), "hi", "stop[1]", ALL),
    ("more stop strings than allowed", dict(stop=["a", "b", "c"]), "hi", "stop", SERVER),
    ("a stop token id outside the vocabulary", dict(stop_token_ids=[3, -1]), "hi", "stop_token_ids[1]", ALL),
    ("logprobs above max_logprobs", dict(logprobs=21), "hi", "logprobs", ALL),
    ("prompt_logprobs above max_logprobs", dict(prompt_logprobs=21), "hi", "prompt_logprobs", ALL),
    ("a biased id outside the vocabulary", dict(logit_bias={1029: 1.0}), "hi", "logit_bias[1029]", ALL),
    ("a bias above 100", dict(logit_bias={5: 101.0}), "hi", "logit_bias[5]", ALL),
    ("an allowed id of -1", dict(allowed_token_ids=[1, -1]), "hi", "allowed_token_ids[1]", ALL),
    ("a prompt id outside the vocabulary", {}, [5, VOCAB], "{prompt}[1]", ALL),
    ("a prompt as long as the context", {}, [5] * CONTEXT, "{prompt}", ALL),
    ("prompt + max_tokens past the context", dict(max_tokens=600), IDS_500, "max_tokens", ALL),
    ("prompt + max_tokens past the KV pool", dict(max_tokens=600), "hi", "max_tokens", ALL),
]  # fmt: skip


@pytest.fixture(scope="module")
def service(tiny_llama):
    args = ["--num-kv-blocks", str(KV_BLOCKS), "--http-port", "0", "--tokenizer-workers", "1"]
    args += ["--max-n", str(MAX_N), "--max-stop-strings", str(MAX_STOP)]
    with ServiceProcess(tiny_llama, *args) as sp:
        yield sp


@pytest.fixture(scope="module")
def grpc_client(service):
    with LLMServeClient(service.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=KV_BLOCKS)


def through_http(service, fields: dict, prompt) -> str:
    body = {"prompt": prompt, "max_tokens": 4, **fields}
    if "logit_bias" in body:
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}  # JSON keys are text
    r = httpx.post(service.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def through_grpc(client, fields: dict, prompt) -> str:
    kind = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
    with pytest.raises(grpc.RpcError) as e:
        client.generation.Generate(build_request(**kind, **{"max_tokens": 4, **fields}), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return field_violations(e.value)[0].field


def through_llm(llm, fields: dict, prompt) -> str:
    with pytest.raises(ValueError) as e:
        llm.generate(prompt, SamplingParams(**{"max_tokens": 4, **fields}), use_tqdm=False)
    assert hasattr(e.value, "violations"), f"not a field-named refusal: {e.value}"
    return e.value.violations[0].field


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_door_names_the_same_field(service, grpc_client, llm, case):
    _, fields, prompt, field, doors = case
    named = {}
    if "http" in doors:
        named["http"] = through_http(service, fields, prompt)
    if "grpc" in doors:
        named["grpc"] = through_grpc(grpc_client, fields, prompt)
    if "offline" in doors:
        named["offline"] = through_llm(llm, fields, prompt)
    assert named == {door: field.format(prompt=PROMPT_FIELD[door]) for door in doors}


def test_nothing_refused_reached_the_engine_and_it_still_serves(service, grpc_client, llm):
    assert service.engine_stats().num_refused_submits == 0  # the gateway answered every one first
    assert grpc_client.generate("still serving", max_tokens=2).finish_reason != 0
    assert not llm.engine.requests
