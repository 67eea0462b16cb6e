"""Calls in the forms models write beside their template's (``--tool-call-forms on``): fenced and bare
JSON, pythonic; and everything that must stay text (a JSON example of something else, an unknown
tool, arguments the schema refuses, code, a call inside a sentence or beside an answer, a call whose
every value the conversation never said, a form cut short). Each case is parsed whole and streamed
cut at every character (and in random pieces): the pieces joined equal the whole-text parse, and the
parser never takes back content it sent."""

from __future__ import annotations

import json
import random

import pytest

from gateway.tool_request import ToolOptions, plan_tools
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tests.test_tool_parsers import _stream  # the stricter reader: names once, in order
from tokenizer_svc.tool_parsers import ToolCallStream, get_parser
from tokenizer_svc.tool_parsers.written_forms import WrittenForms


def _fn(name, props, required):
    schema = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    _fn("get_weather", {"city": {"type": "string", "description": "a city, e.g. London"}}, ["city"]),
    _fn("get_stock_price", {"symbol": {"type": "string"}}, ["symbol"]),
    _fn("convert", {"amount": {"type": "number"}, "to": {"type": "string"}}, ["amount", "to"]),
    _fn("now", {}, []),
]
# The conversation the calls must draw on (a written call is one only if it holds a value said here).
SAID = ["What's the weather in Paris? And the price of AAPL.", "Also convert 100 dollars to EUR."]
PARIS = '{"city": "Paris"}'
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
TWO = [("get_weather", PARIS), ("get_stock_price", '{"symbol": "AAPL"}')]

# (model output, expected content, expected [(name, arguments JSON)])
CALLS = [
    (FENCED, "", [("get_weather", PARIS)]),  # Qwen2.5-Coder-1.5B's answer
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", PARIS)]),  # 0.5B's
    ('```\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```', "", [("get_weather", PARIS)]),
    ('```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_stock_price", "arguments": {"symbol": "AAPL"}}]\n```', "", TWO),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '{"name": "get_stock_price", "arguments": {"symbol": "AAPL"}}', "", TWO),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
     '```json\n{"name": "get_stock_price", "arguments": {"symbol": "AAPL"}}\n```', "", TWO),
    ('get_weather(city="Paris")', "", [("get_weather", PARIS)]),
    ("[get_weather(city='Paris'), get_stock_price(symbol='AAPL')]", "", TWO),
    ("```python\nget_weather(city='Paris')\nget_stock_price(symbol='AAPL')\n```", "", TWO),
    ('  {"name": "convert", "arguments": {"amount": 100, "to": "EUR"}}  ', "",
     [("convert", '{"amount": 100, "to": "EUR"}')]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "paris"}}\n```', "",  # case aside
     [("get_weather", '{"city": "paris"}')]),
    ('{"name": "convert", "arguments": {"amount": 100, "to": "JPY"}}', "",  # 100 was said, JPY not
     [("convert", '{"amount": 100, "to": "JPY"}')]),
    ('{"name": "now", "arguments": {}}', "", [("now", "{}")]),  # no value to have been said
    # the template's own format still goes through the server's parser
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>', "",
     [("get_weather", PARIS)]),
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n{FENCED}', "",
     [("get_weather", PARIS), ("get_weather", PARIS)]),
]  # fmt: skip

TEXTS = [
    "The weather in Paris is usually mild.",
    '```json\n{\n  "name": "John Doe",\n  "age": 30\n}\n```',  # a JSON example of something else
    'Here is a user:\n```json\n{"name": "John Doe", "age": 30}\n```\nAnything else?',
    '```json\n{"name": "multiply", "arguments": {"a": 12, "b": 7}}\n```',  # not one of the tools
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # fails the schema (city required)
    '{"name": "get_weather", "arguments": {"city": 42}}',  # fails the schema (a string)
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 7}',  # not the call's shape
    '{"name": "get_weather", "arguments": "Paris"}',
    'Call it like {"name": "get_weather", "arguments": {"city": "Paris"}} and see.',  # in a sentence
    '{"name": "get_weather", "arguments": {"city": "Paris"}} is the call to make.',
    "```python\ndef reverse_string(s):\n    return s[::-1]\n```",
    "```python\nresult = get_weather(city='Paris')\nprint(result)\n```",  # code that uses the tool
    '```javascript\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # not a call's fence
    "get_weather is the tool for that.",
    "get_weather(city) takes a city.",
    "get_weather('Paris')",  # positional: not a call's shape
    "[1] is a citation, not a call.",
    # beside an answer or a sentence, a well-formed call of a tool is still text
    f"Let me check.\n{FENCED}",
    f"{FENCED}\nI will tell you when it answers.",
    f'{FENCED}\n```js\nx = {{"name": "get_weather", "arguments": {PARIS}}}\n```',
    f'Paris is the capital of France.\n{{"name": "get_weather", "arguments": {PARIS}}}',
    # every value the model's own: never said in the conversation (only in a tool's description)
    '{"name": "get_weather", "arguments": {"city": "London"}}',
    '{"name": "get_weather", "arguments": {"city": "Pari"}}',  # a part of a word is not the word
    '{"name": "convert", "arguments": {"amount": 12, "to": "GBP"}}',
    "get_weather(city='Madrid')",
    # one of two calls a guess: the reply is text
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '{"name": "get_stock_price", "arguments": {"symbol": "MSFT"}}',
    "To sort, use `sorted()`:\n```python\nnumbers = [5, 2, 8]\nprint(sorted(numbers))\n```\nDone.",
    '```json\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short by the token limit
    '{"name": "get_weather", "arguments": {"city": "Paris"',
    "{ not json at all\nget_weather(city='Paris')",  # an unclosed brace: the rest is its text
    "",
    " \n ",
]
CASES = CALLS + [(t, t, []) for t in TEXTS]


def _parser():
    return WrittenForms(get_parser("hermes"), TOOLS, SAID)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_text_parse(text, content, calls):
    out = _parser().parse(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls


@pytest.mark.parametrize("text,content,calls", CASES)
def test_stream_cut_at_every_character_equals_whole(text, content, calls):
    assert _stream(_parser(), list(text)) == (content, calls)
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream(_parser(), pieces) == (content, calls)


def test_text_that_cannot_be_a_call_is_not_held():
    """A JSON example or code streams as it is written once its first key or word says it is no
    call (not at the fence's end)."""
    s = ToolCallStream(_parser())
    assert s.feed('```json\n{\n  "na').content == ""  # may still be a call
    assert s.feed('me": "get_').content == ""  # "get_..." may still be a tool's name
    assert s.feed('name", ').content == '```json\n{\n  "name": "get_name",'  # no tool's
    assert s.feed('\n  "age": 30').content == ' \n  "age": 30'  # (the trailing space was held)
    s = ToolCallStream(_parser())
    assert s.feed('{"user": ').content == '{"user":'  # no call's first key (the space held)
    s = ToolCallStream(_parser())
    assert s.feed("```python\ndef f(): pass").content == "```python\ndef f(): pass"


def test_without_the_option_the_written_forms_stay_text():
    assert get_parser("hermes").parse(FENCED).content == FENCED


def _chat(choice: str = "auto"):
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Weather in Paris?")])
    for t in TOOLS:
        fn = t["function"]
        chat.tools.add(name=fn["name"], parameters=json.dumps(fn["parameters"]))
    if choice == "auto":
        chat.tool_choice.mode = pb.ToolChoice.MODE_AUTO
    else:
        chat.tool_choice.mode = pb.ToolChoice.MODE_REQUIRED
    return chat


def _marker(s):
    return json.dumps(s)


def test_the_plan_reads_written_forms_only_where_the_server_says():
    on = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", tool_call_forms=True)
    off = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    plan = plan_tools(_chat(), on, False, _marker)
    assert isinstance(plan.parser, WrittenForms) and plan.parser.parse(FENCED).calls
    assert not isinstance(plan_tools(_chat(), off, False, _marker).parser, WrittenForms)
    # a required call is written by the grammar in the template's format: nothing else to read
    assert not isinstance(plan_tools(_chat("required"), on, False, _marker).parser, WrittenForms)


def test_the_option_needs_auto_tool_choice():
    with pytest.raises(ValueError, match="--tool-call-forms on needs --enable-auto-tool-choice"):
        ToolOptions(tool_call_parser="hermes", tool_call_forms=True)


def test_a_schema_jsonschema_refuses_trusts_no_written_call():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}
    text = '{"name": "f", "arguments": {}}'
    assert WrittenForms(get_parser("hermes"), [bad], SAID).parse(text).content == text


def test_the_plan_draws_on_every_message_and_earlier_call():
    """The plan's parser reads the request's own conversation: its messages' contents (any role)
    and the arguments of earlier calls; the tools' descriptions are not part of it."""
    on = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", tool_call_forms=True)
    chat = _chat()
    chat.messages[0].content = "What is the capital of France?"
    assert plan_tools(chat, on, False, _marker).parser.parse(FENCED).content == FENCED
    turn = chat.messages.add(role="assistant")
    turn.tool_calls.add(id="call_1", name="get_stock_price", arguments='{"symbol": "PARIS"}')
    assert plan_tools(chat, on, False, _marker).parser.parse(FENCED).calls
    chat = _chat()
    chat.messages[0].content = "Hi"
    chat.messages.add(role="assistant", content="Paris is lovely.")
    chat.messages.add(role="user", content="How is it there today?")
    assert plan_tools(chat, on, False, _marker).parser.parse(FENCED).calls


def test_text_before_a_form_streams_at_once_and_keeps_the_form_text():
    s = ToolCallStream(_parser())
    assert s.feed("Sure").content == "Sure"
    assert s.feed(f".\n{FENCED}").content == f".\n{FENCED}"
    assert s.finish().calls == []


def test_a_reply_of_forms_is_held_until_it_ends():
    """A call followed by anything but blank space is text, so the calls come only at the end."""
    s = ToolCallStream(_parser())
    assert s.feed(FENCED + "\n").content == "" and not s.feed("").calls
    done = s.finish()
    assert done.content == "" and [(c.name, c.arguments) for c in done.calls] == [("get_weather", PARIS)]
