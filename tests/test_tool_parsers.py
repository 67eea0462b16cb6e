"""Each tool-call parser against hand-written model outputs, and its streaming path fed the same
text cut at every character (and in random pieces): the pieces joined equal the whole-text parse."""

from __future__ import annotations

import json
import random

import pytest

from tokenizer_svc.tool_parsers import PARSERS, ToolCallStream, get_parser

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a \\"quoted\\" }{ ] string", "opts": {"n": [1, 2, {"x": null}]}, "ok": true}'

# (parser, model output, expected content, expected [(name, arguments JSON)])
CASES = [
    ("hermes", "Just text, no calls.", "Just text, no calls.", []),
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', "",
     [("get_weather", WEATHER)]),
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "a", "arguments": {WEATHER}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "b", "arguments": {NESTED}}}\n</tool_call>', "Let me look.",
     [("a", WEATHER), ("b", NESTED)]),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', "", [("late", '{"x": 1}')]),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ("hermes", "a < b and <tool_ca", "a < b and <tool_ca", []),
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"city": "Par', "", [("cut", '{"city": "Par')]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    ("llama3_json",
     f'<|python_tag|>{{"name": "a", "parameters": {WEATHER}}}; {{"name": "b", "parameters": {NESTED}}}',
     "", [("a", WEATHER), ("b", NESTED)]),
    ("llama3_json", "The answer is {42}.", "The answer is {42}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral",
     f'[TOOL_CALLS][{{"name": "w", "arguments": {WEATHER}}}, {{"name": "b", "arguments": {NESTED}}}]',
     "", [("w", WEATHER), ("b", NESTED)]),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "a", "arguments": {WEATHER}}}]', "Sure.", [("a", WEATHER)]),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]b[ARGS]{NESTED}", "",
     [("get_weather", WEATHER), ("b", NESTED)]),
    ("mistral", "No [TOOL_CALL here", "No [TOOL_CALL here", []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), b(n=[1, 2], ok=True, x=None, f=-1.5)]', "",
     [("get_weather", WEATHER), ("b", '{"n": [1, 2], "ok": true, "x": null, "f": -1.5}')]),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    ("pythonic", "[f(s='a ] \\' ) string', t=true)]", "", [("f", '{"s": "a ] \' ) string", "t": true}')]),
    ("pythonic", "No calls here.", "No calls here.", []),
    *[(name, text, text, []) for name in ("hermes", "llama3_json", "mistral", "pythonic")
      for text in ("", " \n ")],
]  # fmt: skip


def _stream(parser, pieces):
    s = ToolCallStream(parser)
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.calls:
            if c.index not in calls:
                assert c.name is not None, "a call's first delta names it"
                assert c.index == len(calls), "calls are announced in order"
                calls[c.index] = [c.name, ""]
            else:
                assert c.name is None, "only the first delta names the call"
            calls[c.index][1] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_text_parse(name, text, content, calls):
    out = get_parser(name).parse(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls
    for c in out.calls:
        if c.name != "cut":
            json.loads(c.arguments)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_cut_at_every_character_equals_whole(name, text, content, calls):
    parser = get_parser(name)
    whole = parser.parse(text)
    want = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    assert _stream(parser, list(text)) == want  # one character per delta
    for cut in range(len(text) + 1):  # every two-piece split
        assert _stream(parser, [text[:cut], text[cut:]]) == want, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream(parser, pieces) == want


def test_arguments_stream_in_pieces_before_the_call_closes():
    s = ToolCallStream(get_parser("hermes"))
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    d = s.feed(head)
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, "get_weather", '{"city": "Pa')]
    d = s.feed('ris"}}\n</tool_call>')
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, None, 'ris"}')]


def test_unknown_parser_is_refused_with_the_list():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_parser("nope")
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_served_call_ids_have_the_formats_shape(name):
    """The gateway's ids for a reply's calls: 9 letters or digits for mistral (its templates refuse
    a history with other ids), OpenAI's ``call_...`` otherwise; unique per call."""
    import re

    from gateway.chat_output import ChatOutput
    from llmserve_proto.llmserve.v1 import generation_pb2 as pb

    text = {
        "hermes": '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
        "llama3_json": '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
        "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
        "pythonic": "[f(), g()]",
    }[name]
    msg = ChatOutput(get_parser(name), None).apply(
        pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP)
    )
    ids = [c.id for c in msg.tool_calls]
    shape = r"[0-9a-zA-Z]{9}" if name == "mistral" else r"call_[0-9a-f]{24}"
    assert len(ids) == 2 and len(set(ids)) == 2 and all(re.fullmatch(shape, i) for i in ids), ids
