"""The Anthropic Messages API and OpenAI's Responses API through the real service on the default
model, spoken by the real clients: the ``anthropic`` SDK (create, stream, a tool round trip,
count_tokens, the ``?beta=true`` door Claude Code uses), the ``openai`` SDK's ``responses.create``
(whole, streamed, a function tool and its output), and one ``openai-agents`` turn with a tool.

Each reply is checked against an independent reader: the same conversation through
``/v1/chat/completions`` (greedy, so the text must be the same), the streamed events reassembled
against the whole reply, calls against their JSON Schemas. One server for the module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.service_process import ServiceProcess

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        # As Claude Code's own tools write a map: propertyNames says only that keys are strings.
        "tags": {
            "type": "object",
            "propertyNames": {"type": "string"},
            "properties": {"k": {"type": "string", "maxLength": 4}},
            "additionalProperties": False,
        },
    },
    "required": ["city", "days"],
    "additionalProperties": False,
    "$schema": "https://json-schema.org/draft/2020-12/schema",
}
ASK = "What's the weather in Oslo for 3 days?"
MODEL = "smollm2"  # not "default": Claude Code reads that name as its own alias
NODE_DIR = Path(__file__).resolve().parent / "node"
GREEDY = {"temperature": 0}
STOPS = [" ", ".", "\n"]


@pytest.fixture(scope="module")
def service(default_model_dir, tmp_path_factory):
    # The default tiny model with a 16k context: Claude Code's own prompt is 4-5.5k tokens in its
    # 8k-word vocabulary (it varies from run to run), past the built-in 4,096.
    import json
    import shutil

    model = tmp_path_factory.mktemp("long_context") / "model"
    shutil.copytree(default_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 16384
    (model / "config.json").write_text(json.dumps(cfg))
    args = ["--num-kv-blocks", "1024", "--http-port", "0", "--served-model-name", MODEL]
    args += ["--chat-template", str(TEMPLATES / "tool_chat_template_hermes.jinja")]
    args += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--max-prompt-chars", "100000"]
    with ServiceProcess(model, *args) as sp:
        yield sp


@pytest.fixture(scope="module")
def claude(service):
    return anthropic.Anthropic(base_url=service.http_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(service):
    return openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat_text(oai, messages, max_tokens):
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content, r.choices[0].finish_reason


# --- Anthropic Messages -----------------------------------------------------------------------------


def test_messages_text_is_the_chat_reply_whole_and_streamed(claude, oai, service):
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    want, finish = _chat_text(oai, [{"role": "system", "content": "You are terse."}, *ask], 24)
    m = claude.messages.create(model=MODEL, max_tokens=24, system=system, messages=ask, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert m.usage.output_tokens > 0
    count = claude.messages.count_tokens(model=MODEL, system=system, messages=ask).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count
    with claude.messages.stream(
        model=MODEL, max_tokens=24, system=system, messages=ask, extra_body=GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == want == final.content[0].text and len(pieces) > 1
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_messages_raw_events_are_anthropics_sequence(service):
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    with httpx.stream("POST", service.http_url + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 8


def test_claude_codes_request_shape_is_accepted(claude, oai):
    """``/v1/messages?beta=true``, a beta header, unknown top-level fields, adaptive thinking, a
    ``system`` message inside ``messages`` and ``max_tokens`` far beyond the context (clamped; the
    reply is ended early by stop sequences, as the chat reply it is compared with)."""
    messages = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                          {"type": "text", "text": "Blue."}]},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Another?"},
    ]  # fmt: skip
    m = claude.beta.messages.create(
        model=MODEL, max_tokens=32000, messages=messages, thinking={"type": "adaptive"},
        stop_sequences=STOPS,
        betas=["interleaved-thinking-2025-05-14"], metadata={"user_id": "u"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "low"}, **GREEDY},
        stream=False, timeout=120,
    )  # fmt: skip
    chat = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Another?"},
    ]
    r = oai.chat.completions.create(
        model=MODEL, messages=chat, stop=STOPS, **GREEDY
    )  # the rest of the context
    want, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert m.content[0].text == want and finish == "stop"
    assert m.stop_reason in ("stop_sequence", "end_turn")


def test_stop_sequences(claude, oai):
    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    whole, _ = _chat_text(oai, ask, 24)
    word = whole.split()[2]
    m = claude.messages.create(model=MODEL, max_tokens=24, messages=ask, stop_sequences=[word],
                               extra_body=GREEDY)  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == whole[: whole.index(word)]


def test_tool_round_trip(claude):
    tools = [{"name": "get_weather", "description": "Forecast for a city.", "input_schema": WEATHER}]
    ask = {"role": "user", "content": ASK}
    for seed, stream in ((0, False), (1, True)):
        options = dict(model=MODEL, max_tokens=200, tools=tools, messages=[ask],
                       tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                       extra_body={"temperature": 1.0, "seed": seed})  # fmt: skip
        if stream:
            with claude.messages.stream(**options) as s:
                deltas = [e for e in s if e.type == "content_block_delta"]
                m = s.get_final_message()
            assert "".join(e.delta.partial_json for e in deltas) == json.dumps(
                m.content[0].input, separators=(",", ":")
            )
        else:
            m = claude.messages.create(**options)
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
        call = m.content[0]
        assert call.name == "get_weather" and call.id
        jsonschema.validate(call.input, WEATHER)
    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "Sunny, 20C"}],
    }
    history = [ask, {"role": "assistant", "content": m.content}, {"role": "user", "content": [result]}]
    reply = claude.messages.create(model=MODEL, max_tokens=16, tools=tools, messages=history,
                                   tool_choice={"type": "none"}, extra_body=GREEDY)  # fmt: skip
    assert reply.content[0].type == "text" and reply.content[0].text
    # The tool result is in the prompt: it counts.
    n = claude.messages.count_tokens(model=MODEL, tools=tools, messages=history).input_tokens
    assert n == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert n > claude.messages.count_tokens(model=MODEL, tools=tools, messages=[ask]).input_tokens


def test_errors_are_anthropics_shape_naming_the_field(claude, service):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]}],
        )  # fmt: skip
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    r = httpx.post(service.http_url + "/v1/messages", json={"model": MODEL, "messages": [
        {"role": "user", "content": "x"}]}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    # A keyword the grammar engine lacks refuses a forced call, naming it; "auto" never needs it.
    bad = {"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {"maxLength": 2}}}}
    tools = [{"name": "f", "input_schema": bad}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, tools=tools, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "x"}])  # fmt: skip
    message = e.value.body["error"]["message"]
    assert "tools[0].input_schema" in message and '"if"' in message
    ok = claude.messages.create(
        model=MODEL, max_tokens=4, tools=tools, messages=[{"role": "user", "content": "x"}]
    )
    assert ok.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_only_a_prompt_over_the_context_is_refused(claude, oai):
    """max_tokens beyond the context left is clamped (the other tests ask 32000 of a 8192 context);
    a prompt that alone does not fit is refused, the error naming its length and the context's."""
    import re

    context = oai.models.list().data[0].model_extra["max_model_len"]
    words = "hi " * (context + 8)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": words}])
    message = e.value.body["error"]["message"]
    assert message.startswith("messages: ") and str(context) in message, message
    assert re.search(r"has \d+ tokens", message), message  # the prompt's length, and the context's
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=words, max_output_tokens=10**6)
    assert e.value.body["param"] == "input" and str(context) in e.value.body["message"]


# --- OpenAI Responses -------------------------------------------------------------------------------


def test_responses_text_is_the_chat_reply(oai):
    want, finish = _chat_text(oai, [{"role": "system", "content": "Be terse."},
                                    {"role": "user", "content": "Name a color."}], 16)  # fmt: skip
    r = oai.responses.create(model=MODEL, instructions="Be terse.", input="Name a color.",
                             max_output_tokens=16, **GREEDY)  # fmt: skip
    assert r.output_text == want and r.object == "response"
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_streamed_function_call_and_its_output(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Forecast.", "parameters": WEATHER}]
    stream = oai.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}], tools=tools,
                                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                  temperature=1.0, stream=True)  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done.arguments == call.arguments
    follow = oai.responses.create(model=MODEL, tools=tools, max_output_tokens=12, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 20C"},
    ], tool_choice="none", **GREEDY)  # fmt: skip
    assert follow.output[0].type == "message" and follow.output_text


def test_responses_refuses_stored_state(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"


def test_openai_agents_runs_a_turn_with_a_tool(service):
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Lima"]) -> str:
        """The weather of a city."""
        seen.append(city)
        return "Sunny"

    client = openai.AsyncOpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0)
    agent = Agent(
        name="weather", instructions="Answer with the tool.", tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=64, temperature=0.0),
        tool_use_behavior="stop_on_first_tool",  # the tool's output is the answer: one model turn
    )  # fmt: skip
    result = asyncio.run(Runner.run(agent, "Weather in Oslo?", max_turns=3))
    assert seen and seen[0] in ("Oslo", "Lima")
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem"]
    assert result.final_output == "Sunny"


# --- Claude Code itself -----------------------------------------------------------------------------


def test_claude_code_answers_through_the_server(service, tmp_path):
    """``claude -p ... --bare --tools ""`` (npm's @anthropic-ai/claude-code, installed by `make test`
    into tests/node) with ANTHROPIC_BASE_URL at the server: its own request shape, streamed."""
    import shutil
    import subprocess

    claude = NODE_DIR / "node_modules" / ".bin" / "claude"
    if shutil.which("node") is None:
        pytest.skip("node is not installed: Claude Code cannot run")
    if not claude.exists():
        pytest.skip(f"Claude Code is not installed: `cd {NODE_DIR} && npm ci` installs it (package.json)")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),  # no user settings, no keychain, no history
        "ANTHROPIC_BASE_URL": service.http_url,
        "ANTHROPIC_API_KEY": "sk-local-test",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    before = service.log_tail(10**7).count(" finished outcome=")
    out = subprocess.run(
        [str(claude), "-p", "Say hello.", "--bare", "--tools", "", "--model", MODEL],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    answer = out.stdout.split("\n")[-2] if out.stdout.endswith("\n") else out.stdout
    assert answer.strip() and "issue with the selected model" not in out.stdout, out.stdout
    log = service.log_tail(10**7)
    assert log.count(" finished outcome=") > before, "the answer came from this server"


def test_the_docs_examples_run(service):
    """docs/client-apis.md's Python examples as written, with its address and model name swapped
    for this server's."""
    import contextlib
    import io
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "client-apis.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 2
    for code in blocks:
        code = code.replace("http://127.0.0.1:8000", service.http_url).replace('"local"', repr(MODEL))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "docs/client-apis.md", "exec"), {})
        assert "get_weather" in out.getvalue(), out.getvalue()
