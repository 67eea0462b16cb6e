"""A rendered chat prompt encoded piece by piece between its special tokens, long pieces' ids kept
across requests (tokenizer_svc/piece_cache.py): the ids of the whole text's encode, on real
tokenizers, for random texts made of the pieces that make encoding hard (markers with and without
whitespace beside them, added tokens that are not special, digits, code, other scripts), the
first time and from the cache."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.conftest import shared_tokenizer
from tokenizer_svc.piece_cache import MIN_CHARS, PieceCache, piecewise_exact
from tokenizer_svc.tokenizer import Tokenizer, load_tokenizer

WORDS = [
    " the", "The", "  ", " ", "\n", "\n\n", "\t", "    return x", "def f(a, b):", "1234567", " 42",
    "3.14", "naïve", "日本語のテキスト", "Привет", "🙂", "'s", "don't", "{\"type\": \"object\"}", "</tools>",
    "<tools>", "x=y", "...", "—", "\r\n", "é", "ß", "a" * 40,
]  # fmt: skip


def chat_text(tok: Tokenizer, rng: random.Random, chars: int) -> str:
    specials = [t for t in tok._specials.pattern.pattern.replace("\\", "").split("|") if t]
    hf = tok._hf
    added = [t.content for t in hf.added_tokens_decoder.values() if not t.special]
    out: list[str] = []
    while sum(map(len, out)) < chars:
        r = rng.random()
        if r < 0.04 and specials:
            out.append(rng.choice(specials))
        elif r < 0.06 and added:
            out.append(rng.choice(added))
        else:
            out.append(rng.choice(WORDS))
    return "".join(out)


@pytest.mark.parametrize("name", ["qwen2", "llama3", "gpt2"])
def test_pieces_encode_to_the_whole_texts_ids(name):
    tok = load_tokenizer(shared_tokenizer(name))
    assert tok._pieces is not None, f"{name}'s tokenizer should allow piecewise encoding"
    rng = random.Random(7)
    long_piece = chat_text(tok, random.Random(8), 3 * MIN_CHARS).replace("<", "[")  # few markers
    for k in range(30):
        text = chat_text(tok, rng, rng.choice([MIN_CHARS, 2 * MIN_CHARS, 6 * MIN_CHARS]))
        if k % 3 == 0:  # a system prompt every turn resends, then the turn's own text
            text = long_piece + text
        whole = tok.encode(text, add_special_tokens=False)
        assert tok._encode_rendered(text, True) == whole, f"{name}: example {k} differs from the whole"
        assert tok._encode_rendered(text, True) == whole, f"{name}: example {k} differs from the cache"
    assert tok._pieces.hits > 0 and tok._pieces.misses > 0


def test_a_chat_sessions_turns_get_the_rendered_texts_ids():
    """Through ``apply_chat_template`` (the worker's call), turn after turn: the ids of the rendered
    text's whole encode, the long system message (with the tools) from the cache after turn 1."""
    tok = load_tokenizer(shared_tokenizer("qwen2"))
    system = "You are a coding agent.\n" + "Rules: keep it short, 1 2 3. " * 200
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi there"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d " * 300, "parameters": {}}}]
    for turn in range(3):
        ids = tok.apply_chat_template(msgs, tools=tools)
        assert ids == tok.encode(tok.render_chat(msgs, tools=tools), add_special_tokens=False), turn
        msgs += [{"role": "assistant", "content": f"Answer {turn}."}, {"role": "user", "content": "More?"}]
    assert tok._pieces.hits == 2 and tok._pieces.misses == 1


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer whose pre-tokenizer prepends "▁" to a text's first piece only."""
    vocab = {"<unk>": 0, "<sep>": 1, "▁": 2, "a": 3, "b": 4, "▁a": 5, "▁b": 6}
    rust = RustTokenizer(models.BPE(vocab, [("▁", "a"), ("▁", "b")], unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    rust.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": ["<sep>"]})
    return hf


def test_a_tokenizer_that_prepends_by_position_is_encoded_whole():
    hf = metaspace_tokenizer()
    text = ("a b<sep>b a" * 200)[: 2 * MIN_CHARS]
    backend = hf.backend_tokenizer
    whole = backend.encode(text, add_special_tokens=False).ids
    cut = []  # what a piecewise encode would give: its pieces after the first get a "▁" too
    for i, piece in enumerate(text.split("<sep>")):
        cut += ([1] if i else []) + backend.encode(piece, add_special_tokens=False).ids
    assert cut != whole, "the example lost its point: pieces encode alike here"
    assert not piecewise_exact(hf)
    tok = Tokenizer(hf)
    assert tok._pieces is None and tok._encode_rendered(text, True) == whole


def test_the_cache_is_bounded_in_characters():
    cache = PieceCache(max_chars=3000, min_chars=100)
    calls = []

    def encode(piece: str) -> list[int]:
        calls.append(piece)
        return [len(piece)]

    for piece in ("a" * 1000, "b" * 1000, "a" * 1000, "c" * 1500, "a" * 1000, "b" * 1000):
        assert list(cache.ids(piece, encode)) == [len(piece)]
    # a, b, a (hit), c (b out: a was used last), a (hit), b (again: encoded)
    assert calls == ["a" * 1000, "b" * 1000, "c" * 1500, "b" * 1000]
    assert cache.chars <= 3000
    assert list(cache.ids("x" * 50, encode)) == [50] and "x" * 50 not in cache._ids
