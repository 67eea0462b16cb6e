"""StopStringMatcher: held-back streaming gives the same text as cutting the whole text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_svc.stop_strings import StopStringMatcher


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The whole text cut at the first stop string to complete (earliest end, then earliest start)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)  # ending at the same place, the longest starts earliest
            return text[: end if include else end - len(stop)], stop
    return text, None


def run(text: str, cuts: list[int], stops: list[str], include: bool) -> tuple[str, str | None, list[str]]:
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    emitted, matched = [], None
    for a, b in zip(bounds, bounds[1:], strict=False):
        result = matcher.push(text[a:b])
        emitted.append(result.text)
        if result.matched is not None:
            assert matched is None, "a matcher reports one match at most"
            matched = result.matched
    if matched is None:
        emitted.append(matcher.flush())
    return "".join(emitted), matched, emitted


ALPHABET = "abc你🦀 "
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=12),
    stops=stop_lists,
    include=st.booleans(),
)
def test_any_split_equals_the_reference(text, cuts, stops, include):
    out, matched, _ = run(text, cuts, stops, include)
    assert (out, matched) == reference(text, stops, include)


def test_match_spanning_many_pushes_is_never_partly_sent():
    matcher = StopStringMatcher(["STOP"])
    sent = [matcher.push(p) for p in ["go S", "T", "O", "P and more"]]
    assert [r.text for r in sent] == ["go ", "", "", ""]
    assert [r.matched for r in sent] == [None, None, None, "STOP"]
    assert matcher.finished and matcher.push("later").text == "" and matcher.flush() == ""


def test_include_stop_string_sends_it_but_nothing_after():
    matcher = StopStringMatcher(["</s>"], include_stop_str_in_output=True)
    assert matcher.push("x</").text == "x"
    result = matcher.push("s>tail")
    assert (result.text, result.matched) == ("</s>", "</s>")


def test_false_start_is_released_when_it_cannot_be_a_stop():
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xab").text == "x"
    assert matcher.push("d").text == "abd"
    assert matcher.push("a").text == ""
    assert matcher.flush() == "a"


def test_first_stop_to_complete_wins_over_an_earlier_starting_longer_one():
    matcher = StopStringMatcher(["abcd", "bc"])
    result = matcher.push("abcd")
    assert (result.text, result.matched) == ("a", "bc")


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.push("anything").text == "anything" and matcher.flush() == ""


@pytest.mark.parametrize("bad", [[""], "stop", [None]])
def test_invalid_stop_lists_are_rejected(bad):
    with pytest.raises(ValueError):
        StopStringMatcher(bad)
