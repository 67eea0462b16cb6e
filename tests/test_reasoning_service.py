"""--reasoning-parser through the real service and the openai client: a JSON-schema answer after
optional thinking (qwen3) has valid JSON as its content and the thinking in reasoning_content, the
same streamed (delta.reasoning_content) as not; tool calls still parse with reasoning on."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.service_process import ServiceProcess

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


# Qwen3's thinking switch, added after the hermes template's generation prompt (it acts only where a
# request passes enable_thinking, so the other tests here see the hermes template as it is).
SWITCH = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "hermes_with_thinking_switch.jinja"
    path.write_text((TEMPLATES / "tool_chat_template_hermes.jinja").read_text() + SWITCH)
    return path


@pytest.fixture(scope="module")
def service(default_model_dir, template):
    args = ["--num-kv-blocks", "512", "--http-port", "0", "--served-model-name", "default"]
    args += ["--chat-template", str(template)]
    args += ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with ServiceProcess(default_model_dir, *args) as sp:
        yield sp


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service.http_url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_schema_answer_after_optional_thinking(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    answered = thought_seen = 0
    for seed in range(4):
        options = dict(model="default", messages=MESSAGES, response_format=fmt, temperature=1.0, seed=seed,
                       max_tokens=60)  # fmt: skip
        whole = client.chat.completions.create(**options).choices[0]
        thought = getattr(whole.message, "reasoning_content", None) or ""
        if whole.finish_reason == "stop":
            jsonschema.validate(json.loads(whole.message.content), SCHEMA)
            answered += 1
        else:  # cut while thinking (a random model may think until max_tokens)
            assert whole.finish_reason == "length"
        assert "<think>" not in (whole.message.content or "") and "</think>" not in thought
        content, streamed_thought = "", ""
        for chunk in client.chat.completions.create(**options, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            streamed_thought += getattr(delta, "reasoning_content", None) or ""
        assert (content, streamed_thought) == (whole.message.content or "", thought)
        thought_seen += bool(thought)
    # A random model that opens <think> rarely closes it: the answer side is checked with
    # llguidance's matcher in test_reasoning.py; here at least the split must have happened.
    assert answered or thought_seen, "neither an answer nor a thought: the test checked nothing"


def test_required_call_with_reasoning_on(client):
    r = client.chat.completions.create(
        model="default", messages=MESSAGES, tools=[TOOL], tool_choice="required", temperature=1.0, seed=3,
        max_tokens=80,
    )  # fmt: skip
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    else:
        assert choice.finish_reason == "length"  # still thinking at max_tokens


def test_ollama_think_false_switches_thinking_off_in_the_template(service, default_model_dir, template):
    """Ollama's think: false reaches the template as enable_thinking=false (the turn is rendered
    with an empty thought, as Qwen3's template does), true and unset leave it on; the prompt the
    engine gets is the one the template renders in process with that switch."""
    import ollama

    from tokenizer_svc.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir, template)
    msgs = [{"role": "user", "content": "Say hi."}]
    counts = {think: len(tok.apply_chat_template(msgs, enable_thinking=think)) for think in (False, None)}
    assert counts[False] > counts[None]  # the switch changes the prompt
    oll = ollama.Client(host=service.http_url, timeout=120)
    options = {"temperature": 0, "num_predict": 2}
    off = oll.chat(model="default", messages=msgs, think=False, options=options)
    on = oll.chat(model="default", messages=msgs, think=True, options=options)
    unset = oll.chat(model="default", messages=msgs, options=options)
    assert off.prompt_eval_count == counts[False] and not off.message.thinking
    assert on.prompt_eval_count == unset.prompt_eval_count == counts[None]
    gen = oll.generate(model="default", prompt="Say hi.", think=False, options=options)
    assert gen.prompt_eval_count == counts[False]
