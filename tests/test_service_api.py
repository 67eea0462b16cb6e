"""The service end to end: real engine, tokenizer worker and gateway processes on localhost.

One service (module scope) serves every test here; the offline engine runs in this process on
the same model for the token-for-token comparisons.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.client import LLMServeClient, build_request
from gateway.errors import field_violations
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from tests.service_process import ServiceProcess

PROMPTS = {
    "english": "The quick brown fox jumps over the lazy dog because",
    "chinese": "今天天气很好，我们去公园散步吧。",
    "emoji": "Party time 🎉🥳 with friends 👩‍👩‍👧 and cake 🍰",
}


@pytest.fixture(scope="module")
def service(default_model_dir):
    with ServiceProcess(default_model_dir, "--num-kv-blocks", "1024", "--tokenizer-workers", "1") as sp:
        yield sp


@pytest.fixture(scope="module")
def client(service):
    with LLMServeClient(service.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from tokenizer_svc.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def offline(default_model_dir):
    """Greedy and seeded generations from the offline engine, for comparison."""
    from engine_svc import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(default_model_dir), num_kv_blocks=256))

    def run(prompt_ids, params):
        engine.add_request("x", list(prompt_ids), params)
        out: dict[int, list[int]] = {}
        while engine.has_unfinished_requests():
            for d in engine.step():
                out.setdefault(d.index, []).extend(d.new_token_ids)
        return out

    return run


def collect(stream):
    """Concatenate a stream's messages per sequence index."""
    seqs: dict[int, dict] = {}
    for msg in stream:
        s = seqs.setdefault(msg.index, {"text": "", "ids": [], "msgs": [], "final": None})
        s["text"] += msg.text
        s["ids"] += list(msg.token_ids)
        s["msgs"].append(msg)
        if msg.finish_reason:
            assert s["final"] is None, "a sequence finished twice"
            s["final"] = msg
    return seqs


def wait_engine_idle(service, within_s: float) -> float:
    """Seconds until the engine holds no request and no KV block (fails after ``within_s``)."""
    start = time.monotonic()
    while True:
        st = service.engine_stats()
        if st.load.kv_blocks_used == 0 and st.num_live_requests == 0 and st.load.num_running == 0:
            return time.monotonic() - start
        if time.monotonic() - start > within_s:
            pytest.fail(f"engine not idle after {within_s}s: {st}")
        time.sleep(0.02)


@pytest.mark.parametrize("lang", list(PROMPTS))
def test_streamed_greedy_equals_offline_engine_and_text_equals_decode(client, tokenizer, offline, lang):
    from engine_svc.sampling_params import SamplingParams

    prompt = PROMPTS[lang]
    seqs = collect(client.generate_stream(prompt, temperature=0.0, max_tokens=24, return_token_ids=True))
    s = seqs[0]
    want = offline(tokenizer.encode(prompt), SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert s["ids"] == want
    assert s["text"] == tokenizer.decode(want)
    assert s["final"].usage.completion_tokens == len(want)
    assert s["final"].usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert s["final"].finish_reason in (gen.FINISH_REASON_LENGTH, gen.FINISH_REASON_STOP)


def _boundary_stop(tokenizer, ids):
    """A 4-character stop string that straddles a token boundary, and where it starts."""
    full = tokenizer.decode(ids)
    for k in range(2, len(ids) - 1):
        head = tokenizer.decode(ids[:k])
        nxt = tokenizer.decode(ids[: k + 1])
        if not full.startswith(head) or "\ufffd" in nxt or len(nxt) - len(head) < 2 or len(head) < 2:
            continue
        stop = full[len(head) - 2 : len(head) + 2]
        if full.find(stop) == len(head) - 2 and stop.strip():
            return stop, len(head) - 2
    pytest.skip("no clean token boundary in this generation")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(service, client, tokenizer, include):
    prompt = PROMPTS["english"]
    base = collect(client.generate_stream(prompt, temperature=0.0, max_tokens=24, return_token_ids=True))[0]
    stop, at = _boundary_stop(tokenizer, base["ids"])
    full = tokenizer.decode(base["ids"])
    got = collect(
        client.generate_stream(
            prompt, temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=include
        )
    )[0]
    assert got["text"] == (full[: at + len(stop)] if include else full[:at])
    assert got["final"].finish_reason == gen.FINISH_REASON_STOP
    assert got["final"].stop_string == stop
    wait_engine_idle(service, 1.0)  # the gateway aborted the engine's request at the match


def test_n_sequences_are_indexed_and_match_the_offline_engine(client, tokenizer, offline):
    from engine_svc.sampling_params import SamplingParams

    prompt = PROMPTS["english"]
    seqs = collect(
        client.generate_stream(prompt, n=3, temperature=1.0, seed=7, max_tokens=10, return_token_ids=True)
    )
    assert sorted(seqs) == [0, 1, 2]
    want = offline(tokenizer.encode(prompt), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10))
    for i in range(3):
        assert seqs[i]["ids"] == want[i]
        assert seqs[i]["text"] == tokenizer.decode(want[i])
        assert seqs[i]["final"].usage.completion_tokens == len(want[i])
    unary = client.generate(prompt, n=3, temperature=1.0, seed=7, max_tokens=10, return_token_ids=True)
    assert [list(s.token_ids) for s in [unary, *unary.additional_sequences]] == [want[0], want[1], want[2]]


def test_stop_string_in_one_of_n_sequences_leaves_the_others_running(service, client, tokenizer):
    prompt = PROMPTS["chinese"]
    free = collect(
        client.generate_stream(prompt, n=2, temperature=1.0, seed=3, max_tokens=16, return_token_ids=True)
    )
    text0 = tokenizer.decode(free[0]["ids"])
    stop = next(
        (
            text0[i : i + 2]
            for i in range(4, len(text0) - 2)
            if text0[i : i + 2].strip()
            and "\ufffd" not in text0[i : i + 2]
            and text0[i : i + 2] not in tokenizer.decode(free[1]["ids"])
        ),
        None,
    )
    if stop is None:
        pytest.skip("no stop string that only sequence 0 contains")
    got = collect(
        client.generate_stream(
            prompt, n=2, temperature=1.0, seed=3, max_tokens=16, stop=[stop], return_token_ids=True
        )
    )
    assert got[0]["final"].stop_string == stop and got[0]["text"] == text0[: text0.find(stop)]
    assert got[1]["ids"] == free[1]["ids"]  # the sibling ran to its end, undisturbed
    wait_engine_idle(service, 1.0)


def test_logprobs_and_prompt_logprobs(client, tokenizer):
    prompt = PROMPTS["english"]
    seqs = collect(
        client.generate_stream(
            prompt, temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, return_token_ids=True
        )
    )
    s = seqs[0]
    lps = [lp for m in s["msgs"] for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == s["ids"]
    for lp in lps:
        assert lp.rank == 1 and lp.logprob <= 0  # greedy: the sampled token is the most likely
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
    plps = [lp for m in s["msgs"] for lp in m.prompt_logprobs]
    prompt_ids = tokenizer.encode(prompt)
    assert [lp.token_id for lp in plps] == prompt_ids[1:]


def test_chat_input_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hi 👋"}]
    ids = client.tokenize(messages=messages)
    assert ids == tokenizer.apply_chat_template(messages)
    seqs = collect(client.generate_stream(messages=messages, temperature=0.0, max_tokens=8))
    assert seqs[0]["final"].usage.prompt_tokens == len(ids)


def test_tokenize_detokenize_round_trip(client, tokenizer):
    text = "Round trip: 中文, émoji 🎉, tabs\tand newlines\n."
    ids = client.tokenize(text)
    assert ids == tokenizer.encode(text)
    assert client.detokenize(ids) == text


def test_health_check_and_watch(service):
    with grpc.insecure_channel(service.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "llmserve.v1.Generation", "llmserve.v1.Models"):
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(service):
    with grpc.insecure_channel(service.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for s in next(responses).list_services_response.service}
    assert {"llmserve.v1.Generation", "llmserve.v1.Models", "grpc.health.v1.Health"} <= names


def test_model_info_reports_the_limits(client):
    info = client.model_info()
    assert info.vocab_size == 8192 and info.max_model_len == 4096 and info.num_kv_blocks == 1024
    assert info.limits.max_n >= 1 and info.limits.max_logprobs == 20 and info.has_chat_template
    assert [m.name for m in client.list_models().models] == [info.name]
    with pytest.raises(grpc.RpcError) as e:
        client.model_info("no-such-model")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


BAD_INPUTS = [
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_k=-5), "top_k"),
    (dict(prompt="hi", min_p=1.5), "min_p"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hi", presence_penalty=3.0), "presence_penalty"),
    (dict(prompt="hi", n=0), "n"),
    (dict(prompt="hi", n=1000), "n"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=10**6), "max_tokens"),
    (dict(prompt="hi", min_tokens=50, max_tokens=10), "min_tokens"),
    (dict(prompt="hi", stop=[""]), "stop[0]"),
    (dict(prompt="hi", stop=["x" * 1000]), "stop[0]"),
    (dict(prompt="hi", stop_token_ids=[-1]), "stop_token_ids[0]"),
    (dict(prompt="hi", logprobs=100), "logprobs"),
    (dict(prompt=""), "text"),
    (dict(token_ids=[1, 2, 999999]), "token_ids.ids[2]"),
    (dict(token_ids=[-3]), "token_ids.ids[0]"),
    (dict(token_ids=[5] * 5000), "token_ids.ids", "4095"),  # prompt too long: the limit is named
    (dict(prompt="hello world " * 3000, max_tokens=16), "text", "4095"),
    (dict(token_ids=[5] * 4090, max_tokens=16), "max_tokens", "4096"),
    (dict(messages=[]), "chat.messages"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[1] for c in BAD_INPUTS])
def test_bad_input_gets_invalid_argument_naming_the_field(service, client, case):
    kwargs, field, limit = dict(case[0]), case[1], (case[2] if len(case) > 2 else None)
    prompt = kwargs.pop("prompt", None)
    if "messages" in kwargs and not kwargs["messages"]:
        req = gen.GenerateRequest(chat=gen.Chat())
    else:
        req = build_request(prompt, **kwargs)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generation.GenerateStream(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    violations = field_violations(e.value)
    assert field in [v.field for v in violations], violations
    if limit is not None:
        assert any(limit in v.description for v in violations if v.field == field), violations
    assert service.engine_stats().num_live_requests == 0  # nothing reached the engine
    assert client.generate("still serving", max_tokens=2).finish_reason != 0


def test_missing_prompt_unknown_model_and_duplicate_request_id(service, client):
    with pytest.raises(grpc.RpcError) as e:
        client.generation.Generate(gen.GenerateRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(e.value)] == ["prompt"]
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hi", model="gpt-17")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    first = client.generate_stream("hello", request_id="same-id", max_tokens=200, ignore_eos=True)
    next(iter(first))
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hello", request_id="same-id", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    wait_engine_idle(service, 1.0)


def test_fifty_cancelled_streams_return_every_block_within_a_second(service, client):
    calls = [
        client.generate_stream(f"story number {i}:", max_tokens=400, ignore_eos=True, temperature=0.8)
        for i in range(50)
    ]
    for call in calls:
        next(iter(call))  # each is mid-generation
    assert service.engine_stats().load.kv_blocks_used > 0
    for call in calls:
        call.cancel()
    wait_engine_idle(service, 60)  # the cancels land (the bound: a hang)
    assert service.engine_stats(check_invariants=True).invariant_error == ""


def test_short_deadline_gives_deadline_exceeded_and_frees_blocks(service, client):
    with pytest.raises(grpc.RpcError) as e:  # ended by the deadline (3000 tokens would end OK)
        list(client.generate_stream("tell me everything", max_tokens=3000, ignore_eos=True, timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_engine_idle(service, 60)


def test_concurrent_streams_complete(client):
    results = {}

    def run(i):
        results[i] = collect(client.generate_stream(f"prompt {i}", max_tokens=12, ignore_eos=True))[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8
    assert all(r["final"].usage.completion_tokens == 12 for r in results.values())


def test_seeds_use_all_64_bits_through_the_service(client):
    """The proto's int64 seed is whole: 5, 5 - 2**63, 2**32 + 5, 0 and -2**63 draw different tokens
    (they drew alike when the engine seeded torch's 32-bit CPU generator), and each repeats."""
    seeds = [5, 5 - 2**63, 2**32 + 5, 0, -(2**63)]
    outs = [
        tuple(
            client.generate(
                "Seeds:", temperature=1.0, seed=s, max_tokens=24, ignore_eos=True, return_token_ids=True
            ).token_ids
        )
        for s in seeds
    ]
    assert len(set(outs)) == len(seeds), outs
    again = client.generate(
        "Seeds:", temperature=1.0, seed=2**32 + 5, max_tokens=24, ignore_eos=True, return_token_ids=True
    )
    assert tuple(again.token_ids) == outs[2]
