"""Tool calling through the real service (``llmserve serve --http-port``): the real ``openai``
client, streamed and not, a random-weight model whose required and named calls always parse and
validate against their schemas, the OpenAI streaming shape reassembling to the whole response,
400s naming the field, and the same through gRPC llmserve.v1."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc
from tests.service_process import ServiceProcess

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Clock.", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What's the weather in Oslo for 3 days?"}]


@pytest.fixture(scope="module")
def service(default_model_dir):
    args = ["--num-kv-blocks", "1024", "--http-port", "0", "--served-model-name", "default"]
    args += ["--chat-template", str(TEMPLATES / "tool_chat_template_hermes.jinja")]
    args += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--max-prompt-chars", "100000"]
    with ServiceProcess(default_model_dir, *args) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _check_calls(calls, names=None):
    assert calls, "a required call was made"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _reassemble(stream):
    """OpenAI's streamed shape back into calls: index, id, type and name on a call's first delta,
    argument pieces after."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for t in delta.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.type == "function" and t.function.name, "the first delta names the call"
                    calls[t.index] = {
                        "id": t.id,
                        "name": t.function.name,
                        "arguments": t.function.arguments or "",
                    }
                else:
                    assert t.id is None and t.function.name is None
                    calls[t.index]["arguments"] += t.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_always_parse_and_validate(client, parallel):
    for seed in range(3):
        r = client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_named_call_is_that_function(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls
        _check_calls(calls, ["get_time"])
        assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"


def test_streamed_calls_reassemble_to_the_whole_response(client):
    for seed in range(3):
        options = dict(
            model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        whole = client.chat.completions.create(**options).choices[0]
        content, calls, finish = _reassemble(client.chat.completions.create(**options, stream=True))
        want = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in whole.message.tool_calls
        ]
        assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in want]
        assert finish == whole.finish_reason == "tool_calls"
        assert content == (whole.message.content or "")


def test_auto_answers_with_text_or_well_formed_calls(client):
    r = client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=24
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        _check_calls(choice.message.tool_calls)


def test_history_with_calls_and_tool_results_is_rendered(client):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "rain"}'},
    ]  # fmt: skip
    r = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > 100  # the tools and the call were rendered into the prompt
    plain = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=1)
    assert plain.usage.prompt_tokens < r.usage.prompt_tokens


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
          "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f",
                     "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param):
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.body["param"] == param, e.value.body


def test_tools_count_toward_the_prompt_limit(client):
    huge = {"type": "function", "function": {"name": "f", "description": "x" * 200_000}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=MESSAGES, tools=[huge], max_tokens=2)
    assert e.value.body["param"] == "tools" and "max_prompt_chars" in e.value.body["message"]


def test_grpc_chat_with_tools(service):
    with grpc.insecure_channel(service.target) as channel:
        stub = gen_grpc.GenerationStub(channel)
        req = gen.GenerateRequest(max_tokens=200, temperature=1.0, seed=7)
        req.chat.messages.add(role="user", content=MESSAGES[0]["content"])
        for t in TOOLS:
            fn = t["function"]
            req.chat.tools.add(
                name=fn["name"], description=fn["description"], parameters=json.dumps(fn["parameters"])
            )
        req.chat.tool_choice.mode = gen.ToolChoice.MODE_REQUIRED
        whole = stub.Generate(req, timeout=120)
        assert whole.finish_reason == gen.FINISH_REASON_TOOL_CALLS
        assert whole.text == "" and whole.tool_calls
        for c in whole.tool_calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        pieces: dict[int, list[str]] = {}
        for msg in stub.GenerateStream(req, timeout=120):
            for c in msg.tool_calls:
                if c.name:
                    pieces[c.index] = [c.id, c.name, c.arguments]
                else:
                    pieces[c.index][2] += c.arguments
        streamed = [(p[1], p[2]) for _, p in sorted(pieces.items())]
        assert streamed == [(c.name, c.arguments) for c in whole.tool_calls]
        req.chat.tool_choice.function = "nope"
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat.tool_choice" in e.value.details()


def test_a_tool_request_beside_others_equals_its_solo_run(client):
    """Batch invariance with tools: the grammar-constrained request's calls do not depend on what
    else shares its steps (other tool requests, plain chats, other seeds)."""
    from concurrent.futures import ThreadPoolExecutor

    def tool_request(seed: int, choice="required"):
        r = client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
            temperature=1.0, seed=seed, max_tokens=120,
        )  # fmt: skip
        c = r.choices[0]
        return c.message.content, [
            (t.function.name, t.function.arguments) for t in c.message.tool_calls or []
        ]

    def plain(seed: int):
        client.chat.completions.create(
            model="default", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=40
        )

    solo = tool_request(11)
    named = {"type": "function", "function": {"name": "get_weather"}}
    with ThreadPoolExecutor(4) as pool:
        mixed = pool.submit(tool_request, 11)
        others = [
            pool.submit(plain, 1),
            pool.submit(tool_request, 12, named),
            pool.submit(tool_request, 13, "auto"),
        ]
        assert mixed.result() == solo
        for f in others:
            f.result()


def test_tokenize_renders_tools_like_the_chat_request(service, client):
    import httpx

    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with_tools = httpx.post(service.http_url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()
    without = httpx.post(service.http_url + "/tokenize", json={"messages": MESSAGES}).json()
    assert with_tools["count"] > without["count"] + 50
    r = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert r.usage.prompt_tokens == with_tools["count"]
    bad = httpx.post(service.http_url + "/tokenize", json={"messages": MESSAGES, "tools": [{"type": "nope"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0]"
