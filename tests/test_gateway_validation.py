"""Request validation alone: every field rule, defaults for unset fields, all violations at once."""

from __future__ import annotations

import grpc
import pytest

from gateway.client import build_request
from gateway.errors import RequestError
from gateway.limits import Limits
from gateway.validation import check_prompt_length, validate_generate
from llmserve_proto.llmserve.v1 import generation_pb2 as gen

VOCAB, CTX = 1000, 512


def fields(req) -> list[str]:
    with pytest.raises(RequestError) as e:
        validate_generate(req, VOCAB, CTX, Limits())
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return [v.field for v in e.value.violations]


def test_unset_fields_take_defaults_and_zero_is_not_unset():
    v = validate_generate(build_request("hi"), VOCAB, CTX, Limits())
    p = v.params
    assert (p.temperature, p.top_p, p.top_k, p.n, p.max_tokens, p.seed, p.logprobs) == (
        1.0,
        1.0,
        0,
        1,
        16,
        None,
        None,
    )
    assert p.skip_special_tokens is True
    v = validate_generate(
        build_request("hi", temperature=0.0, logprobs=0, seed=0, skip_special_tokens=False),
        VOCAB,
        CTX,
        Limits(),
    )
    assert (v.params.temperature, v.params.logprobs, v.params.seed) == (0.0, 0, 0)
    assert v.params.skip_special_tokens is False


def test_every_violation_is_reported_at_once():
    req = build_request("hi", temperature=-1.0, top_p=2.0, n=0, max_tokens=0, stop=["", "ok"], logprobs=50)
    assert fields(req) == ["temperature", "top_p", "n", "max_tokens", "stop[0]", "logprobs"]


def test_prompt_rules():
    assert fields(gen.GenerateRequest()) == ["prompt"]
    assert fields(build_request(token_ids=[1, VOCAB])) == ["token_ids.ids[1]"]
    assert fields(build_request(token_ids=[1] * CTX)) == ["token_ids.ids"]
    assert fields(build_request("x" * (Limits().max_prompt_chars + 1))) == ["text"]
    assert fields(build_request(messages=[("", "hello")])) == ["chat.messages[0].role"]


def test_limits_come_from_the_server_settings():
    strict = Limits(max_n=2, max_stop_strings=1, max_logprobs=3)
    with pytest.raises(RequestError) as e:
        validate_generate(build_request("hi", n=3, stop=["a", "b"], logprobs=4), VOCAB, CTX, strict)
    assert [v.field for v in e.value.violations] == ["n", "stop", "logprobs"]
    assert "2" in e.value.violations[0].description


def test_prompt_length_after_tokenizing_names_the_limit():
    check_prompt_length(100, 16, CTX, "text")
    with pytest.raises(RequestError) as e:
        check_prompt_length(CTX, 1, CTX, "text")
    assert e.value.violations[0].field == "text" and str(CTX - 1) in e.value.violations[0].description
    with pytest.raises(RequestError) as e:
        check_prompt_length(500, 16, CTX, "text")
    assert e.value.violations[0].field == "max_tokens"


def test_speculative_opt_out_reaches_the_engine_params():
    """GenerateRequest.speculative: unset or true is the server's default, false never drafts; the
    engine.v1 message carries it through (an independent parse of the bytes the engine gets)."""
    from engine_svc.rpc.convert import sampling_params_from_proto, sampling_params_to_proto
    from llmserve_proto.engine.v1 import engine_pb2

    for opts, want in (({}, True), ({"speculative": True}, True), ({"speculative": False}, False)):
        params = validate_generate(build_request("hi", **opts), VOCAB, CTX, Limits()).params
        assert params.speculative is want
        wire = engine_pb2.SamplingParams.FromString(sampling_params_to_proto(params).SerializeToString())
        assert wire.HasField("speculative") == (not want)
        assert sampling_params_from_proto(wire).speculative is want


def test_allowed_ids_that_min_tokens_bans_all_of_are_refused_before_queueing():
    """allowed_token_ids [EOS] with min_tokens 2: EOS is banned until then, so the request has no
    first token; the gateway knows the engine's EOS ids and answers INVALID_ARGUMENT at once."""
    req = build_request("hi", allowed_token_ids=[5], min_tokens=2)
    with pytest.raises(RequestError) as e:
        validate_generate(req, VOCAB, CTX, Limits(), eos_token_ids=(5,))
    assert [v.field for v in e.value.violations] == ["allowed_token_ids"]
    assert "min_tokens=2" in e.value.violations[0].description
    validate_generate(
        build_request("hi", allowed_token_ids=[5], min_tokens=2, ignore_eos=True),
        VOCAB,
        CTX,
        Limits(),
        eos_token_ids=(5,),
    )
