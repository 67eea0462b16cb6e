"""A chat's tools against the choice and the server's settings (``gateway.tool_request``), and
``llmserve serve`` refusing unknown parser names at start with the list."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.tool_request import HTTP_NAMES, ToolOptions, plan_tools
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
AUTO = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat(*names, choice=None, parallel=None, schema=SCHEMA) -> pb.Chat:
    c = pb.Chat()
    c.messages.add(role="user", content="hi")
    for n in names:
        c.tools.add(name=n, parameters=json.dumps(schema) if schema is not None else "")
    if choice in ("auto", "none", "required"):
        c.tool_choice.mode = {"auto": 0, "none": 1, "required": 2}[choice]
    elif choice is not None:
        c.tool_choice.function = choice
    if parallel is not None:
        c.parallel_tool_calls = parallel
    return c


def plan(c, options=AUTO, constraint=False):
    return plan_tools(c, options, constraint, json.dumps)


def fields(p) -> list[str]:
    return [v.field for v in p.violations]


def test_no_tools_means_no_parsing():
    p = plan(chat())
    assert p.tools is None and p.parser is None and p.grammar is None and not p.violations
    assert not plan(chat(choice="none")).violations  # OpenAI allows "none" without tools


def test_auto_is_the_default_with_tools_and_needs_the_server_flag():
    p = plan(chat("f"))
    assert p.parser.name == "hermes" and p.grammar is not None and not p.forced  # free text or calls
    assert fields(plan(chat("f"), ToolOptions(tool_call_parser="hermes"))) == ["chat.tool_choice"]
    assert fields(plan(chat("f"), ToolOptions())) == ["chat.tool_choice"]
    assert plan(chat("f"), constraint=True).grammar is None  # response_format wins under auto


def test_none_renders_tools_without_parsing():
    p = plan(chat("f", choice="none"), ToolOptions())
    assert p.tools[0]["function"]["name"] == "f" and p.parser is None and p.grammar is None


def test_required_and_named_are_forced_grammars():
    p = plan(chat("f", "g", choice="required"))
    assert p.forced and "fn1" in p.grammar and '("\\n" call){0,7}' in p.grammar  # at most 8 calls
    assert '("\\n" call)' not in plan(chat("f", "g", choice="required", parallel=False)).grammar
    named = plan(chat("f", "g", choice="g"))
    assert named.forced and '\\"g\\"' in named.grammar and '\\"f\\"' not in named.grammar
    assert fields(plan(chat("f", choice="nope"))) == ["chat.tool_choice"]
    assert fields(plan(chat("f", choice="required"), ToolOptions())) == ["chat.tool_choice"]
    assert fields(plan(chat("f", choice="required"), constraint=True)) == ["chat.tool_choice"]
    assert fields(plan(chat(choice="required"))) == ["chat.tool_choice"]


def test_bad_tools_name_their_fields():
    assert fields(plan(chat("f", "f"))) == ["chat.tools[1].name"]
    assert fields(plan(chat(""))) == ["chat.tools[0].name"]
    assert fields(plan(chat("f", schema={"type": "array"}))) == ["chat.tools[0].parameters"]
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    assert fields(plan_tools(chat("f", schema=bad), AUTO, False, json.dumps, HTTP_NAMES)) == [
        "tools[0].function.parameters"
    ]
    assert plan(chat("f", schema=None)).tools[0]["function"].get("parameters") is None


def test_unknown_names_are_refused_with_the_list():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        ToolOptions(tool_call_parser="nope")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ToolOptions(reasoning_parser="nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True)


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--tool-call-parser", "nope"], "hermes, llama3_json, mistral, pythonic"),
        (["--reasoning-parser", "nope"], "deepseek_r1, qwen3"),
        (["--chat-template", "/nonexistent/t.jinja"], "no such file"),
    ],
)
def test_serve_refuses_bad_options_at_start(tmp_path, flags, words):
    r = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--model", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and words in r.stderr, r.stderr


# --- the defaults of `llmserve serve`: the parser the chat template writes, tool_choice auto on ---

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
SERVE_DEFAULTS = ToolOptions(enable_auto_tool_choice=None, tool_call_parser="auto")


@pytest.mark.parametrize("template,parser", [("hermes", "hermes"), ("llama3_json", "llama3_json")])
def test_the_parser_is_the_one_the_template_writes(template, parser):
    text = (TEMPLATES / f"tool_chat_template_{template}.jinja").read_text()
    got = SERVE_DEFAULTS.for_template(text)
    assert (got.tool_call_parser, got.enable_auto_tool_choice) == (parser, True)
    assert not fields(plan(chat("f"), got))  # tool_choice auto is served, no flag given


def test_a_template_without_tools_keeps_auto_off_and_says_why():
    got = SERVE_DEFAULTS.for_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert (got.tool_call_parser, got.enable_auto_tool_choice) == (None, False)
    p = plan(chat("f"), got)
    assert fields(p) == ["chat.tool_choice"] and "--tool-call-parser" in p.violations[0].description
    with pytest.raises(ValueError, match="writes no tool-call format"):
        ToolOptions(enable_auto_tool_choice=True, tool_call_parser="auto").for_template("{{ messages }}")


def test_named_parser_and_switch_win_over_the_template():
    hermes = (TEMPLATES / "tool_chat_template_hermes.jinja").read_text()
    named = ToolOptions(enable_auto_tool_choice=None, tool_call_parser="mistral").for_template(hermes)
    assert (named.tool_call_parser, named.enable_auto_tool_choice) == ("mistral", True)
    off = ToolOptions(enable_auto_tool_choice=False, tool_call_parser="auto").for_template(hermes)
    assert (off.tool_call_parser, off.enable_auto_tool_choice) == ("hermes", False)
    p = plan(chat("f"), off)
    assert fields(p) == ["chat.tool_choice"] and "off on this server" in p.violations[0].description
