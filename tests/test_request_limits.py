"""The shared request rules at their boundaries: each value just inside a rule is accepted and each
just outside is refused naming its field. The bounds are the API's as documented (the proto's
comments, OpenAI's ranges), written here as numbers, not read from the validator."""

from __future__ import annotations

import math

import pytest

from engine_svc.request_limits import InvalidRequest, RequestLimits, prompt_violations
from engine_svc.sampling_params import SamplingParams

LIMITS = RequestLimits(
    vocab_size=1000,
    max_model_len=512,
    max_logprobs=5,
    max_n=4,
    max_tokens=300,
    max_stop_strings=2,
    max_stop_string_chars=8,
    max_stop_token_ids=3,
)

# field: (values accepted, values refused), each with the rest of SamplingParams at its default
BOUNDS = {
    "temperature": ([0.0, 2.5], [-1e-9, math.nan, math.inf]),
    "top_p": ([1e-9, 1.0], [0.0, 1.0 + 1e-9, math.nan]),
    "min_p": ([0.0, 1.0], [-1e-9, 1.0 + 1e-9]),
    "repetition_penalty": ([1e-9, 3.0], [0.0, -1.0]),
    "presence_penalty": ([-2.0, 2.0], [-2.0 - 1e-9, 2.0 + 1e-9]),
    "frequency_penalty": ([-2.0, 2.0], [-2.0 - 1e-9, 2.0 + 1e-9]),
    "top_k": ([-1, 0, 1000], [-2, 1001, 1.5]),
    "n": ([1, 4], [0, 5, True]),
    "seed": ([-(2**63), 2**63 - 1], [2**63, -(2**63) - 1]),
    "max_tokens": ([1, 300], [0, 301]),
    "min_tokens": ([0, 16], [-1, 17]),  # max_tokens is 16 by default
    "logprobs": ([0, 5], [-1, 6]),
    "prompt_logprobs": ([0, 5], [-1, 6]),
    "speculative": ([True, False], [1]),
}
# (fields, the field refused) for the list-valued rules
LIST_CASES = [
    (dict(stop=["a", "b"]), None),
    (dict(stop=["a", "b", "c"]), "stop"),
    (dict(stop=["a", ""]), "stop[1]"),
    (dict(stop=["x" * 8]), None),
    (dict(stop=["x" * 9]), "stop[0]"),
    (dict(stop_token_ids=[0, 999, 5]), None),
    (dict(stop_token_ids=[0, 1000]), "stop_token_ids[1]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids[0]"),
    (dict(stop_token_ids=[1, 2, 3, 4]), "stop_token_ids"),
    (dict(logit_bias={999: -100.0, 0: 100.0}), None),
    (dict(logit_bias={1000: 1.0}), "logit_bias[1000]"),
    (dict(logit_bias={3: 100.5}), "logit_bias[3]"),
    (dict(logit_bias={3: math.nan}), "logit_bias[3]"),
    (dict(allowed_token_ids=[0, 999]), None),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[4, 1000]), "allowed_token_ids[1]"),
    (dict(bad_words_token_ids=[[1, 2], [999]]), None),
    (dict(bad_words_token_ids=[[1], []]), "bad_words_token_ids[1]"),
    (dict(bad_words_token_ids=[[1, 1000]]), "bad_words_token_ids[0][1]"),
]


def refused(**fields) -> list[str]:
    return [v.field for v in SamplingParams(**fields).violations(LIMITS)]


def test_every_rule_at_its_boundaries():
    for field, (good, bad) in BOUNDS.items():
        for value in good:
            assert refused(**{field: value}) == [], (field, value)
        for value in bad:
            assert refused(**{field: value}) == [field], (field, value)
    for fields, field in LIST_CASES:
        assert refused(**fields) == ([] if field is None else [field]), fields


def test_every_violation_at_once_in_field_order():
    assert refused(temperature=-1.0, n=0, max_tokens=0, stop=[""], logprobs=9) == [
        "temperature",
        "n",
        "max_tokens",
        "stop[0]",
        "logprobs",
    ]


def test_prompt_limits_at_their_boundaries():
    pool = RequestLimits(1000, 512, block_size=16, num_kv_blocks=20)  # 320 tokens of KV
    assert prompt_violations(511, 1, LIMITS, "p") == []
    assert [v.field for v in prompt_violations(512, 1, LIMITS, "p")] == ["p"]
    assert [v.field for v in prompt_violations(0, 1, LIMITS, "p")] == ["p"]
    assert prompt_violations(500, 12, LIMITS, "p") == []
    assert [v.field for v in prompt_violations(500, 13, LIMITS, "p")] == ["max_tokens"]
    assert prompt_violations(300, 20, pool, "p") == []
    assert [v.field for v in prompt_violations(300, 21, pool, "p")] == ["max_tokens"]
    assert [v.field for v in prompt_violations(330, 1, pool, "p")] == ["p"]  # the prompt alone is too big
    capped = RequestLimits(1000, 512, max_prompt_tokens=100)
    assert prompt_violations(100, 1, capped, "p") == []
    assert [v.field for v in prompt_violations(101, 1, capped, "p")] == ["p"]


def test_validate_raises_a_value_error_with_the_violations():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0") as e:
        SamplingParams(top_p=0.0, n=0).validate(vocab_size=1000)
    assert isinstance(e.value, InvalidRequest)
    assert [v.field for v in e.value.violations] == ["top_p", "n"]
