"""Logit controls read against an unconstrained run of the same request: a control may change a
token only where its rule says so, and must leave every other position alone."""

from __future__ import annotations

import pytest

from engine_svc import SamplingParams
from tests.differential import Result, drive
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts


def _greedy(engine, rid: str, prompt: list[int], **params) -> list[int]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **params))
    results: dict[str, Result] = {}
    drive(engine, results)
    return results[rid].outputs[0].tokens


def test_a_bad_words_last_token_stays_allowed_after_any_other_token(tiny_llama):
    """A two-token bad word [x, b] bans b only right after x: where greedy decoding emits b after
    something else, the output is exactly the unconstrained one."""
    engine = make_engine(tiny_llama)
    (prompt,) = random_prompts([10], 1024, seed=2)
    plain = _greedy(engine, "plain", prompt)
    b = plain[5]
    x = next(t for t in range(3, 1024) if t not in plain and t not in prompt)  # never precedes b
    assert _greedy(engine, "bad", prompt, bad_words_token_ids=[[x, b]]) == plain
    # ... and a word made of a real pair does ban its last token there (at the pair's first place).
    pairs = [tuple(plain[j - 1 : j + 1]) for j in range(1, len(plain))]
    j = 1 + next(i for i, pair in enumerate(pairs) if pair not in pairs[:i])
    banned = _greedy(engine, "banned", prompt, bad_words_token_ids=[list(pairs[j - 1])])
    assert banned[:j] == plain[:j] and banned[j] != plain[j]
    assert_pool_whole(engine)


def test_allowed_ids_that_the_other_controls_ban_from_the_start_are_refused_up_front(tiny_llama):
    """allowed_token_ids all among the stop/EOS ids while min_tokens is unmet, or all one-token bad
    words: the request could never sample its first token. It is refused when it is added, naming
    the field and the control that bans it, and the caller's params are not touched."""
    from engine_svc.request_limits import InvalidRequest, RequestLimits

    engine = make_engine(tiny_llama)
    (eos,) = engine.spec.eos_token_ids[:1]
    (prompt,) = random_prompts([6], 1024, seed=4)
    refused = [
        (SamplingParams(allowed_token_ids=[eos], min_tokens=2), "min_tokens=2"),
        (
            SamplingParams(
                allowed_token_ids=[7, 9], stop_token_ids=[9], min_tokens=1, bad_words_token_ids=[[7]]
            ),
            "bad_words and min_tokens=1",
        ),
        (SamplingParams(allowed_token_ids=[7, 8], bad_words_token_ids=[[8], [7], [3, 7]]), "bad_words"),
    ]
    for params, why in refused:
        with pytest.raises(InvalidRequest, match=f"allowed_token_ids leaves no token to sample: .* by {why}"):
            engine.add_request("x", prompt, params)
        assert params.eos_token_ids == ()
    limits = RequestLimits(1024, 0, eos_token_ids=(eos,))
    for fine in (
        SamplingParams(allowed_token_ids=[eos], min_tokens=2, ignore_eos=True),  # EOS is not banned
        SamplingParams(allowed_token_ids=[eos, 5], min_tokens=2),  # 5 is left
        SamplingParams(allowed_token_ids=[eos], min_tokens=0),
        SamplingParams(allowed_token_ids=[7], bad_words_token_ids=[[3, 7]]),  # banned only after 3
    ):
        assert fine.violations(limits) == [], fine
    assert not engine.has_unfinished_requests()


def test_a_dead_end_met_later_ends_the_request_with_an_error_naming_its_controls(tiny_llama):
    """allowed_token_ids [a, EOS] with min_tokens 3 and the bad word [a, a]: the first token is a
    (EOS waits for min_tokens); after it the bad word bans a and min_tokens still bans EOS, so
    nothing is left. The request ends there with an abort and an error naming those controls; no
    token its controls forbid is ever emitted (before the fix: token 0), and its neighbour runs
    on as alone."""
    from engine_svc.scheduler import DEAD_END

    engine = make_engine(tiny_llama)
    (eos,) = engine.spec.eos_token_ids[:1]
    (prompt,) = random_prompts([9], 1024, seed=8)
    a = next(t for t in range(2, 1024) if t != eos)
    stuck = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=3, allowed_token_ids=[a, eos], bad_words_token_ids=[[a, a]]
    )
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("stuck", prompt, stuck)
    engine.add_request("plain", prompt, plain)
    results: dict[str, Result] = {}
    errors = []
    while engine.has_unfinished_requests():
        for d in engine.step():
            results.setdefault(d.request_id, Result()).add(d)
            errors += [d.error] if d.error else []
        engine.check_invariants()
    out = results["stuck"].outputs[0]
    assert out.tokens == [a] and out.finish_reason == "abort", out
    assert len(errors) == 1 and errors[0].startswith(DEAD_END), errors
    assert "allowed_token_ids, bad_words, min_tokens=3" in errors[0], errors
    assert results["plain"].outputs[0].tokens == _greedy(make_engine(tiny_llama), "alone", prompt)[:8]
    assert_pool_whole(engine)
