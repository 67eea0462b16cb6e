"""Reasoning output (``--reasoning-parser``): ``<think>...</think>`` split out of the text, streamed
at every character boundary equal to the whole-text split, composed with tool-call parsing; and
constraints (JSON schemas, choices, a client's Lark grammar, tool grammars) applied only after the
reasoning, checked with llguidance's own matcher."""

from __future__ import annotations

import json

import pytest

from engine_svc.structured_outputs import StructuredOutputsParams
from gateway.chat_output import ChatOutput
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tokenizer_svc.reasoning import REASONING_PARSERS, ReasoningStream, get_reasoning_parser
from tokenizer_svc.reasoning_grammar import after_reasoning
from tokenizer_svc.tokenizer import load_tokenizer
from tokenizer_svc.tool_parsers import get_parser
from tokenizer_svc.tool_parsers.markers import marker_for

CASES = [  # (parser, output, reasoning, content)
    ("deepseek_r1", "I should add.\n</think>\n\n4", "I should add.\n", "4"),
    ("deepseek_r1", "<think>\nhmm</think>answer", "\nhmm", "answer"),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", ""),
    ("deepseek_r1", "a </thin b", "a </thin b", ""),
    ("qwen3", "<think>\nplan\n</think>\n\nDone.", "\nplan\n", "Done."),
    ("qwen3", "No thinking here. </think> is text", "", "No thinking here. </think> is text"),
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "", "", ""),
]


def _split(name, text):
    s = get_reasoning_parser(name).split(text, True)
    return s.reasoning, s.content


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_whole_split(name, text, reasoning, content):
    assert _split(name, text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_stream_cut_anywhere_equals_whole(name, text, reasoning, content):
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            s = ReasoningStream(get_reasoning_parser(name))
            parts = [s.feed(p) for p in pieces] + [s.finish()]
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content)


def test_unknown_reasoning_parser_is_refused_with_the_list():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]


def test_chat_output_takes_reasoning_then_calls_out_of_the_text():
    text = '<think>call it</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    for cut in range(len(text) + 1):
        out = ChatOutput(get_parser("hermes"), get_reasoning_parser("qwen3"))
        msgs = [out.apply(pb.GenerateResponse(text=text[:cut]))]
        msgs.append(out.apply(pb.GenerateResponse(text=text[cut:], finish_reason=pb.FINISH_REASON_STOP)))
        assert "".join(m.reasoning_content for m in msgs) == "call it"
        assert "".join(m.text for m in msgs) == ""
        calls = [c for m in msgs for c in m.tool_calls]
        assert calls[0].name == "f" and calls[0].id.startswith("call_")
        assert "".join(c.arguments for c in calls) == '{"a": 1}'
        assert msgs[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS


SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]


JSON_C = StructuredOutputsParams(json=SCHEMA)
CHOICE_C = StructuredOutputsParams(choice=["yes", "no"])
# A client's Lark grammar whose rule names are the thinking's own: nested, they cannot clash.
LARK_C = StructuredOutputsParams(grammar='start: think ";"\nthink: answer+\nanswer: "a" | "b"\n%ignore " "\n')
CALL = '<tool_call>\n{"name": "f", "arguments": {"x":2}}\n</tool_call>'


@pytest.mark.parametrize(
    "name,constraint,accepted,refused",
    [
        ("deepseek_r1", JSON_C, ['free {x </think>\n{"x":1}'], ['{"x":1}', "a</think>no"]),
        ("qwen3", JSON_C, ['<think>{{</think>{"x":1}', '{"x":1}'], ["no", "<think>a</think>b"]),
        ("qwen3", CHOICE_C, ["<think>maybe</think>\nyes", "no"], ["maybe"]),
        ("qwen3", LARK_C, ["<think>a b?</think>\nab a;", "b;"], ["<think>x</think>c;", "ab", "ab;</think>"]),
        ("deepseek_r1", LARK_C, ["hm</think>a b;"], ["a b;", "hm</think>a b"]),
        ("deepseek_r1", "hermes", ["hm</think>" + CALL], [CALL]),
    ],
)
def test_constraints_apply_after_the_reasoning(trained_tokenizer_dir, name, constraint, accepted, refused):
    import llguidance

    tok = load_tokenizer(trained_tokenizer_dir)
    marker = marker_for(tok)
    if constraint == "hermes":
        constraint = StructuredOutputsParams(grammar=get_parser("hermes").grammar(TOOLS, True, marker))
    wrapped = after_reasoning(constraint, get_reasoning_parser(name), marker)
    grammar = wrapped.to_grammar()  # the same checks a request's constraint gets
    ll = llguidance.LLTokenizer(
        str(trained_tokenizer_dir / "tokenizer.json"), n_vocab=tok.vocab_size, eos_token=[tok.eos_token_id]
    )

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(ll, grammar)
        return (
            all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()
        )

    for text in accepted:
        assert accepts(text), text
    for text in refused:
        assert not accepts(text), text
    json.loads(json.dumps(wrapped.grammar))
