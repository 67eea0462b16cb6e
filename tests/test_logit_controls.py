"""Logit controls read against an unconstrained run of the same request: a control may change a
token only where its rule says so, and must leave every other position alone."""

from __future__ import annotations

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
