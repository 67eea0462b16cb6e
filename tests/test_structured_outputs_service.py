"""Structured output and logit controls through the real service: the proto fields, streaming of
constrained output, errors before the engine sees a request, and a Node.js client using a schema."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import jsonschema
import pytest

from gateway.client import LLMServeClient
from gateway.errors import field_violations
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from tests.service_process import ServiceProcess

NODE_DIR = Path(__file__).resolve().parent / "node"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "rain": {"type": "boolean"},
        "mm": {"type": "integer", "minimum": 0, "maximum": 500},
    },
    "required": ["city", "rain", "mm"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def service(default_model_dir):
    with ServiceProcess(default_model_dir, "--num-kv-blocks", "512", "--tokenizer-workers", "1") as sp:
        yield sp


@pytest.fixture(scope="module")
def client(service):
    with LLMServeClient(service.target, timeout=120) as c:
        yield c


def stream_text(client, **options) -> tuple[str, list]:
    text, msgs = "", []
    for msg in client.generate_stream("The weather report:", **options):
        text += msg.text
        msgs.append(msg)
    return text, msgs


def test_json_schema_streams_valid_json(client):
    for seed in range(4):
        text, msgs = stream_text(
            client, json_schema=json.dumps(SCHEMA), temperature=1.0, seed=seed, max_tokens=80
        )
        assert msgs[-1].finish_reason == gen.FINISH_REASON_STOP, text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_regex_and_any_json(client):
    choices = ["sunny", "light rain", "snow 🌨"]
    text, _ = stream_text(client, choice=gen.Choices(choices=choices), temperature=1.0, seed=1, max_tokens=40)
    assert text in choices
    text, _ = stream_text(client, regex=r"[0-9]{2}-[a-z]{3}", temperature=1.0, seed=2, max_tokens=40)
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", text), text
    text, msgs = stream_text(client, json_object=True, temperature=0.7, seed=3, max_tokens=60)
    if msgs[-1].finish_reason == gen.FINISH_REASON_STOP:
        json.loads(text)


def test_logit_bias_allowed_ids_and_bad_words(client):
    plain = client.generate("The weather report:", temperature=0.0, max_tokens=12, return_token_ids=True)
    biased = client.generate(
        "The weather report:", temperature=0.0, max_tokens=6, logit_bias={100: 100.0}, return_token_ids=True
    )
    assert list(biased.token_ids) == [100] * 6
    allowed = client.generate(
        "The weather report:",
        temperature=1.0,
        seed=4,
        max_tokens=10,
        allowed_token_ids=[100, 200, 300],
        return_token_ids=True,
    )
    assert set(allowed.token_ids) <= {100, 200, 300}
    word = client.detokenize(list(plain.token_ids[:1])).strip()
    if word:
        banned = client.generate("The weather report:", temperature=0.0, max_tokens=12, bad_words=[word])
        assert word not in banned.text


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(json_schema='{"type": "objec"}'), "json_schema"),
        (dict(json_schema="{not json"), "json_schema"),
        (dict(regex="(a|b"), "regex"),
        (dict(grammar="start: undefined_rule"), "grammar"),
        (dict(choice=gen.Choices(choices=[])), "choice"),
        (dict(logit_bias={10**7: 1.0}), "logit_bias[10000000]"),
        (dict(logit_bias={5: 500.0}), "logit_bias[5]"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids[0]"),
        (dict(bad_words=[""]), "bad_words[0]"),
    ],
)
def test_bad_constraints_are_invalid_argument_naming_the_field(client, service, options, field):
    with pytest.raises(grpc.RpcError) as err:
        client.generate("hello", max_tokens=4, **options)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in [v.field for v in field_violations(err.value)], err.value.details()
    assert service.engine_stats().num_refused_submits == 0, (
        "the engine saw a request the gateway should refuse"
    )


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_client_with_a_schema(service):
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "run `make test` (or `npm ci` in tests/node) to install the Node.js packages"
    )
    out = subprocess.run(
        [
            "node",
            str(NODE_DIR / "stream_generate.js"),
            service.target,
            "Weather as JSON:",
            "80",
            json.dumps(SCHEMA),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "FINISH_REASON_STOP"
    jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_a_constraint_that_leaves_no_token_is_invalid_argument(client, service):
    """allowed_token_ids that the constraint can never use: the engine finds the dead end at the
    first step, the stream ends INVALID_ARGUMENT naming the constraint, and no blocks stay held."""
    digits = sorted({i for d in "0123456789" for i in client.tokenize(d, add_special_tokens=False)})
    with pytest.raises(grpc.RpcError) as err:
        client.generate("hello", max_tokens=8, regex="[a-c]+", allowed_token_ids=digits)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "constraint" in [v.field for v in field_violations(err.value)], err.value.details()
    assert "no token the request may sample" in err.value.details()
    assert service.engine_stats().load.kv_blocks_used == 0
