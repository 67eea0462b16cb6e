"""The grammar of a required or named call, per parser format: anything a model can write under it
parses as calls of the chosen tools whose arguments validate against their schemas. Checked with
random walks through llguidance's token masks (a random-weight model, without the model), on the
Qwen2 and Llama 3 vocabularies where present and on the project's own tokenizer."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from tests.conftest import shared_tokenizer
from tokenizer_svc.tokenizer import load_tokenizer
from tokenizer_svc.tool_parsers import PARSERS, get_parser
from tokenizer_svc.tool_parsers.markers import marker_for

SCHEMA_A = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 5},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["city"],
    "additionalProperties": False,
}
SCHEMA_B = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": SCHEMA_A}},
    {"type": "function", "function": {"name": "ping", "parameters": SCHEMA_B}},
]
SCHEMAS = {"forecast": SCHEMA_A, "ping": SCHEMA_B}


def random_walk(matcher, tok, vocab_size: int, rng: random.Random, limit: int = 400) -> list[int]:
    import llguidance.torch as lt

    mask = lt.allocate_token_bitmask(1, vocab_size)
    out: list[int] = []
    for _ in range(limit):
        lt.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits).tolist()
        assert allowed, matcher.get_error()
        eos = [t for t in allowed if t in tok.eos]
        if eos and (len(allowed) == len(eos) or rng.random() < 0.5):
            return out
        t = rng.choice([t for t in allowed if t not in tok.eos])
        assert matcher.consume_token(t), matcher.get_error()
        out.append(t)
    raise AssertionError("the walk did not end")


class _Tok:
    def __init__(self, path):
        import llguidance

        self.tok = load_tokenizer(path)
        self.eos = {t for t in (self.tok.eos_token_id,) if t is not None}
        self.vocab = self.tok.vocab_size
        self.ll = llguidance.LLTokenizer(
            str(path / "tokenizer.json"), n_vocab=self.vocab, eos_token=sorted(self.eos)
        )


@pytest.fixture(scope="module", params=["own", "qwen2", "llama3"])
def vocab(request, trained_tokenizer_dir):
    path = trained_tokenizer_dir if request.param == "own" else shared_tokenizer(request.param)
    return _Tok(path)


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("chosen,parallel", [(TOOLS, True), (TOOLS, False), (TOOLS[:1], False)])
def test_every_output_under_the_grammar_is_valid_calls(vocab, name, chosen, parallel):
    import llguidance

    parser = get_parser(name)
    grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar(chosen, parallel, marker_for(vocab.tok)))
    names = {t["function"]["name"] for t in chosen}
    rng = random.Random(f"{name}{parallel}{len(chosen)}")
    for _ in range(6):
        m = llguidance.LLMatcher(vocab.ll, grammar)
        assert not m.is_error(), m.get_error()
        ids = random_walk(m, vocab, vocab.vocab, rng)
        assert m.is_accepting()
        text = vocab.tok.decode(ids, skip_special_tokens=False)
        out = parser.parse(text)
        assert out.calls, text
        assert out.content == "", text
        if not parallel:
            assert len(out.calls) == 1
        for call in out.calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("name,opening", [("hermes", "Sure. <tool_call>"), ("mistral", "Sure. [TOOL_CALLS]"),
                                          ("llama3_json", "{"), ("pythonic", "[")])  # fmt: skip
def test_auto_is_free_text_or_well_formed_calls(trained_tokenizer_dir, name, opening):
    import llguidance

    vocab = _Tok(trained_tokenizer_dir)
    parser = get_parser(name)
    grammar = llguidance.LLMatcher.grammar_from_lark(parser.auto_grammar(TOOLS, True, marker_for(vocab.tok)))
    rng = random.Random(name)
    for _ in range(4):  # free text: anything that does not open a call, ended anywhere
        m = llguidance.LLMatcher(vocab.ll, grammar)
        text = vocab.tok.decode(random_walk(m, vocab, vocab.vocab, rng, limit=2000))
        out = parser.parse(text)
        for call in out.calls:  # a walk that happened to open a call made a well-formed one
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if not out.calls:
            assert out.content == text
    for _ in range(4):  # once a call is opened it can only be a well-formed one
        m = llguidance.LLMatcher(vocab.ll, grammar)
        prefix = vocab.tok.encode(opening, add_special_tokens=False)
        assert all(m.consume_token(t) for t in prefix)
        text = vocab.tok.decode(prefix + random_walk(m, vocab, vocab.vocab, rng), skip_special_tokens=False)
        out = parser.parse(text)
        assert out.calls, text
        for call in out.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    broken = {"hermes": "Sure. <tool_call>oops", "mistral": "Sure. [TOOL_CALLS]oops",
              "llama3_json": "{oops", "pythonic": "[oops"}[name]  # fmt: skip
    m = llguidance.LLMatcher(vocab.ll, grammar)
    assert not all(m.consume_token(t) for t in vocab.tok.encode(broken, add_special_tokens=False))


@pytest.fixture(scope="module")
def own_vocab(trained_tokenizer_dir):
    return _Tok(trained_tokenizer_dir)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_parallel_calls_close_after_the_bound(own_vocab, name):
    """A walk that never ends while it may go on (a model that calls and calls): the grammar ends it
    after MAX_PARALLEL_CALLS whole calls, required and auto alike."""
    import llguidance

    from tokenizer_svc.tool_parsers.base import MAX_PARALLEL_CALLS

    vocab = own_vocab
    parser = get_parser(name)
    marker = marker_for(vocab.tok)
    rng = random.Random(name)
    opening = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{", "pythonic": "["}[name]
    for lark, prefix in (
        (parser.grammar(TOOLS[1:], True, marker), ""),
        (parser.auto_grammar(TOOLS[1:], True, marker), opening),
    ):
        m = llguidance.LLMatcher(vocab.ll, llguidance.LLMatcher.grammar_from_lark(lark))
        ids = vocab.tok.encode(prefix, add_special_tokens=False) if prefix else []
        assert all(m.consume_token(t) for t in ids)
        ids += _walk_to_the_end(m, vocab, rng, avoid="]" if name in ("mistral", "pythonic") else None)
        calls = parser.parse(vocab.tok.decode(ids, skip_special_tokens=False)).calls
        assert len(calls) == MAX_PARALLEL_CALLS and all(c.name == "ping" for c in calls), name


def _walk_to_the_end(
    matcher, tok, rng: random.Random, avoid: str | None = None, limit: int = 2000
) -> list[int]:
    """Tokens allowed by ``matcher``, an end token (or one holding ``avoid``, the list's close) only
    once nothing else is."""
    import llguidance.torch as lt

    mask = lt.allocate_token_bitmask(1, tok.vocab)
    out: list[int] = []
    for _ in range(limit):
        lt.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: tok.vocab]
        allowed = [t for t in np.flatnonzero(bits).tolist() if t not in tok.eos]
        if not allowed:
            return out
        if avoid is not None:
            allowed = [t for t in allowed if avoid not in tok.tok.decode([t])] or allowed
        t = rng.choice(allowed)
        assert matcher.consume_token(t), matcher.get_error()
        out.append(t)
    raise AssertionError("the grammar did not close the list of calls")
