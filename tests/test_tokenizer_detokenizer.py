"""IncrementalDetokenizer: for every split of the ids, the pushes add up to the whole decode."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import shared_tokenizer
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.tokenizer import load_tokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, doesn't it? Yes.",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "emoji": "Family 👨‍👩‍👧‍👦, flag 🇫🇷, skin 👍🏽, heart ❤️‍🔥 and 🦀!",
    "accented": "Ça va? Naïve façade, crème brûlée, Ångström, ñandú, Øresund.",
    "mixed": "def 函数(x):  # 🐍 café\n\treturn x  ",
}
REAL = ["qwen2", "llama3", "gpt2"]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cache
def real_tokenizer(name):
    return load_tokenizer(shared_tokenizer(name))


@pytest.fixture(scope="module")
def trained(trained_tokenizer_dir):
    return load_tokenizer(trained_tokenizer_dir)


def stream(tok, ids, cuts, skip_special_tokens=True):
    """Push ids in the pieces that ``cuts`` make; return each push's text and the flush."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    pieces = [detok.push(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert detok.token_ids == ids
    return detok, pieces, detok.flush()


def check_all_splits_agree(tok, text, cuts):
    ids = tok.encode(text, add_special_tokens=False)
    detok, pieces, rest = stream(tok, ids, cuts)
    assert "".join(pieces) == tok.decode(ids) == detok.text
    assert rest == ""  # the text was valid, so nothing may be left after the last push
    assert all("\ufffd" not in p for p in pieces)  # never half a character


cuts_strategy = st.lists(st.integers(min_value=0, max_value=10_000), max_size=30)


@pytest.mark.parametrize("lang", sorted(TEXTS))
@SETTINGS
@given(cuts=cuts_strategy)
def test_trained_tokenizer_random_splits(trained, lang, cuts):
    check_all_splits_agree(trained, TEXTS[lang], cuts)


@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("lang", sorted(TEXTS))
@SETTINGS
@given(cuts=cuts_strategy)
def test_real_tokenizers_random_splits(name, lang, cuts):
    check_all_splits_agree(real_tokenizer(name), TEXTS[lang], cuts)


@SETTINGS
@given(text=st.text(min_size=1, max_size=60), cuts=cuts_strategy)
def test_arbitrary_unicode_text(trained, text, cuts):
    check_all_splits_agree(trained, text, cuts)


@pytest.mark.parametrize("name", ["trained", *REAL])
def test_one_token_at_a_time_every_language(trained, name):
    tok = trained if name == "trained" else real_tokenizer(name)
    for text in TEXTS.values():
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.push([i]) for i in ids) == text


def test_text_lags_while_a_character_is_incomplete(trained):
    ids = trained.encode("a🦀", add_special_tokens=False)
    assert len(ids) >= 3, "the crab must take several byte tokens for this test to mean anything"
    detok = IncrementalDetokenizer(trained)
    outputs = [detok.push([i]) for i in ids]
    assert outputs[0] == "a" and all(o == "" for o in outputs[1:-1]) and outputs[-1] == "🦀"


def test_several_ids_in_one_push_release_the_complete_part(trained):
    ids = trained.encode("ab🦀", add_special_tokens=False)
    detok = IncrementalDetokenizer(trained)
    # Everything but the crab's last byte: "ab" is final even though the push ends mid-character.
    assert detok.push(ids[:-1]) == "ab"
    assert detok.push(ids[-1:]) == "🦀"


def test_flush_releases_an_incomplete_last_character(trained):
    ids = trained.encode("ok🦀", add_special_tokens=False)[:-1]
    detok, pieces, rest = stream(trained, ids, cuts=[])
    assert "".join(pieces) == "ok" and rest.startswith("\ufffd")
    assert "".join(pieces) + rest == trained.decode(ids)


def test_invalid_bytes_in_the_middle_still_add_up(trained):
    def enc(text):
        return trained.encode(text, add_special_tokens=False)

    ids = enc("x") + enc("🦀")[:-1] + enc("y z")
    detok, pieces, rest = stream(trained, ids, cuts=list(range(len(ids))))
    assert "".join(pieces) + rest == trained.decode(ids)
    assert "\ufffd" in detok.text and detok.text.endswith("y z")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(trained, skip):
    ids = [1, *trained.encode("hi 你好", add_special_tokens=False), 2]
    _, pieces, _ = stream(trained, ids, cuts=list(range(len(ids))), skip_special_tokens=skip)
    assert "".join(pieces) == trained.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


def test_prompt_context_keeps_output_text_the_same_for_byte_level(trained):
    prompt = trained.encode("Question: 你好?", add_special_tokens=False)
    out = trained.encode(" Answer: 👋 fine", add_special_tokens=False)
    detok = IncrementalDetokenizer(trained, prompt_ids=prompt)
    assert "".join(detok.push([i]) for i in out) == trained.decode(out)
    assert detok.token_ids == out


class CountingTokenizer:
    """The real tokenizer, counting how many token ids each decode call is given."""

    def __init__(self, tok):
        self.inner, self.decoded_ids = tok.backend, 0

    @property
    def backend(self):
        return self

    def decode(self, ids, skip_special_tokens):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_sequence(trained):
    ids = trained.encode("".join(TEXTS.values()) * 60, add_special_tokens=False)
    counting = CountingTokenizer(trained)
    detok = IncrementalDetokenizer(counting)
    for i in ids:
        detok.push([i])
    assert detok.text == trained.decode(ids)
    # A whole re-decode per step would be ~len(ids)**2 / 2 token decodes; a window is a constant.
    assert counting.decoded_ids < 12 * len(ids), (counting.decoded_ids, len(ids))


def _cuts_inside_characters(tok, ids):
    return [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]


def test_many_pushes_in_a_row_that_end_mid_character(trained):
    # Every push ends inside a character, many times over: no push may give up on the character in
    # progress (an earlier version emitted U+FFFD after 8 such pushes in a row).
    ids = trained.encode(TEXTS["chinese"] * 3, add_special_tokens=False)
    cuts = _cuts_inside_characters(trained, ids)
    assert len(cuts) >= 12, "the text must split inside characters often for this test to mean anything"
    detok, pieces, rest = stream(trained, ids, cuts)
    assert "".join(pieces) == trained.decode(ids) and rest == ""
    assert all("\ufffd" not in p for p in pieces)


def test_work_stays_bounded_when_pushes_keep_ending_mid_character(trained):
    ids = trained.encode(TEXTS["chinese"] * 40, add_special_tokens=False)
    counting = CountingTokenizer(trained)
    _, pieces, _ = stream(counting, ids, _cuts_inside_characters(trained, ids))
    assert "".join(pieces) == trained.decode(ids)
    assert counting.decoded_ids < 40 * len(ids), (counting.decoded_ids, len(ids))


def test_a_long_run_of_invalid_bytes_then_text(trained):
    def enc(text):
        return trained.encode(text, add_special_tokens=False)

    crab = enc("🦀")
    assert len(crab) >= 2
    ids = enc("x") + crab[1:] * 4 + enc("你好 y")  # continuation bytes with no start: never a character
    detok, pieces, rest = stream(trained, ids, cuts=list(range(len(ids))))
    assert "".join(pieces) + rest == trained.decode(ids)
    assert detok.text.endswith("你好 y") and "\ufffd" in detok.text
