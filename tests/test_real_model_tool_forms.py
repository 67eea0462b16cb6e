"""``--tool-call-forms on`` through a real server on the real Qwen2.5-Coder-0.5B file, greedy: the
fenced JSON call the model writes for a weather prompt comes back as a tool call on every API (the
openai client streamed and whole, the anthropic SDK, the ollama client), and the JSON example it
writes for a prompt that needs no tool stays text. Skipped where `make model` has not placed the
file (tests.conftest.catalogue_model_path says how)."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest

from tests.conftest import catalogue_model_path
from tests.service_process import ServiceProcess
from tests.test_ollama_embeddings_service import WEATHER

ASK = "How's the weather in Tokyo today?"  # the 0.5B answers with a ```json fence
EXAMPLE = "Give me an example JSON object describing a user with a name and an age."


@pytest.fixture(scope="module")
def service():
    path = catalogue_model_path("qwen2.5-coder-0.5b")
    args = ["--http-port", "0", "--served-model-name", "m", "--tool-call-parser", "hermes"]
    args += ["--enable-auto-tool-choice", "--tool-call-forms", "on", "--max-model-len", "4096"]
    with ServiceProcess(path, *args, startup_timeout_s=600) as sp:
        yield sp


def test_a_fenced_call_is_a_call_on_every_api_and_an_example_stays_text(service):
    oai = openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0, timeout=600)
    ask = dict(model="m", tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=64)
    whole = oai.chat.completions.create(messages=[{"role": "user", "content": ASK}], **ask).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Tokyo"}

    pieces, text = {}, ""
    for chunk in oai.chat.completions.create(messages=[{"role": "user", "content": ASK}], stream=True, **ask):
        delta = chunk.choices[0].delta if chunk.choices else None
        text += (delta.content or "") if delta else ""
        for c in (delta.tool_calls or []) if delta else []:
            entry = pieces.setdefault(c.index, ["", ""])
            entry[0] += c.function.name or ""
            entry[1] += c.function.arguments or ""
    assert text == "" and pieces == {0: ["get_weather", call.function.arguments]}

    ant = anthropic.Anthropic(base_url=service.http_url, api_key="none", max_retries=0, timeout=600)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"]}
    tool["input_schema"] = WEATHER["function"]["parameters"]
    msg = ant.messages.create(
        model="m",
        max_tokens=64,
        tools=[tool],
        messages=[{"role": "user", "content": ASK}],
        extra_body={"temperature": 0},
    )
    assert msg.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Tokyo"})
    ]

    oll = ollama.Client(host=service.http_url, timeout=600)
    r = oll.chat(
        model="m", messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
        options={"temperature": 0, "num_predict": 64},
    )  # fmt: skip
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})
    ]

    plain = oai.chat.completions.create(messages=[{"role": "user", "content": EXAMPLE}], **ask).choices[0]
    assert not plain.message.tool_calls and plain.finish_reason == "stop"
    assert '"name": "John Doe"' in plain.message.content  # the example, as the model wrote it
