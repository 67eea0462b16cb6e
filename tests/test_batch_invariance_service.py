"""Each request's result through the real service equals the same request sent alone.

A real ``llmserve serve`` (engine, tokenizer worker and gateway processes) with a small token
budget and a small KV pool, so that prompts are chunked and sequences preempted. Requests with mixed
options (greedy, seeded n > 1, logprobs, prompt logprobs, stop strings and ids, penalties,
min_tokens, priorities) are first sent one at a time, then all at once from concurrent clients
beside a neighbour that cancels mid-stream; every result must equal its solo one: text, token ids,
finish and stop reasons, completion tokens, logprobs and prompt logprobs (bit for bit). The offline
``LLM`` must return the same text for the same request: both use one text pipeline.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from engine_svc import SamplingParams
from gateway.client import LLMServeClient
from tests.engine_helpers import NEAR_TIE
from tests.fault_helpers import assert_engine_clean
from tests.service_process import ServiceProcess

TOL = 0.0  # bitwise: the service runs the CPU fp32 kernels, whose rows never depend on the batch
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split()


def text_of(k: int, words: int) -> str:
    return " ".join(WORDS[(k * 7 + i * 3) % len(WORDS)] for i in range(words))


TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}},
]  # fmt: skip

# (name, prompt words, options); every one is greedy or seeded, so it has one right answer.
REQUESTS = [
    ("greedy", 40, dict(temperature=0.0, max_tokens=24, ignore_eos=True)),
    ("greedy-logprobs", 90, dict(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True)),
    ("prompt-logprobs", 120, dict(temperature=0.0, max_tokens=8, prompt_logprobs=2, ignore_eos=True)),
    ("seeded-n2", 60, dict(temperature=1.0, top_p=0.9, seed=2**40 + 7, n=2, max_tokens=20, ignore_eos=True)),
    (
        "seeded-n3-plp",
        30,
        dict(temperature=0.8, top_k=40, seed=-5, n=3, max_tokens=12, prompt_logprobs=1, logprobs=1),
    ),
    ("stop-string", 50, dict(temperature=0.0, max_tokens=40, stop=[" the", "og"], ignore_eos=True)),
    ("stop-ids", 20, dict(temperature=0.0, max_tokens=30, min_tokens=5, stop_token_ids=[5, 9, 13, 17, 21])),
    (
        "penalties",
        70,
        dict(temperature=0.9, seed=11, repetition_penalty=1.3, presence_penalty=0.4, max_tokens=24),
    ),
    ("priority", 100, dict(temperature=0.0, max_tokens=16, priority=-1, ignore_eos=True)),
    ("short", 3, dict(temperature=0.0, max_tokens=30, ignore_eos=True)),
    # A chat whose required call is decoded under the tools' grammar (and parsed into tool_calls).
    ("tools-required", 12, dict(temperature=1.0, seed=5, max_tokens=60, tools=TOOLS, tool_choice="required")),
]


@pytest.fixture(scope="module")
def service(default_model_dir):
    args = ["--num-kv-blocks", "40", "--block-size", "16", "--max-num-batched-tokens", "64"]
    args += ["--scheduling-policy", "priority", "--tokenizer-workers", "1", "--tool-call-parser", "hermes"]
    with ServiceProcess(default_model_dir, *args) as sp:
        yield sp


def run(client: LLMServeClient, name: str, words: int, options: dict, solo: bool) -> dict:
    opts = dict(options, return_token_ids=True)
    if solo and opts.get("temperature") == 0.0:
        opts["logprobs"] = max(2, opts.get("logprobs") or 0)  # to judge a greedy near-tie
    out: dict[int, dict] = {}
    prompt = text_of(len(name), words)
    chat = {"messages": [{"role": "user", "content": prompt}]} if "tools" in opts else {"prompt": prompt}
    for msg in client.generate_stream(**chat, **opts):
        s = out.setdefault(
            msg.index, {"text": "", "ids": [], "lps": [], "plp": [], "final": None, "calls": []}
        )
        s["text"] += msg.text
        s["calls"] += [(c.index, c.name, c.arguments) for c in msg.tool_calls]
        s["ids"] += list(msg.token_ids)
        s["lps"] += list(msg.logprobs)
        s["plp"] += list(msg.prompt_logprobs)
        if msg.finish_reason:
            s["final"] = msg
    return out


def same_logprob(a, b, n: int, where: str) -> None:
    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL, f"{where}: {a} vs solo {b}"
    for x, y in zip(a.top[:n], b.top[:n], strict=True):
        assert abs(x.logprob - y.logprob) <= TOL, f"{where}: top {a.top} vs solo {b.top}"


def compare(name: str, options: dict, got: dict, ref: dict) -> str | None:
    assert sorted(got) == sorted(ref) == list(range(options.get("n", 1))), name
    note = None
    for i in got:
        g, r = got[i], ref[i]
        where = f"{name}[{i}]"
        if g["ids"] != r["ids"]:
            pos = next(
                k for k, (a, b) in enumerate(zip(g["ids"] + [-1], r["ids"] + [-2], strict=False)) if a != b
            )
            top = r["lps"][pos].top if pos < len(r["lps"]) else []
            tie = (
                options.get("temperature") == 0.0
                and len(top) >= 2
                and top[0].logprob - top[1].logprob < NEAR_TIE
            )
            assert tie, f"{where}: token ids differ at {pos}\n mix:  {g['ids']}\n solo: {r['ids']}"
            note = f"{where}: greedy near-tie at {pos}"
            continue
        assert g["text"] == r["text"], where
        assert g["calls"] == r["calls"], where
        if "tools" in options:
            assert g["calls"] and gf_is_tool_calls(g), where
        gf, rf = g["final"], r["final"]
        assert gf.finish_reason == rf.finish_reason and gf.WhichOneof("stop_reason") == rf.WhichOneof(
            "stop_reason"
        )
        assert getattr(gf, gf.WhichOneof("stop_reason") or "text") == getattr(
            rf, rf.WhichOneof("stop_reason") or "text"
        )
        assert gf.usage.completion_tokens == rf.usage.completion_tokens == len(g["ids"])
        assert gf.usage.prompt_tokens == rf.usage.prompt_tokens
        n = options.get("logprobs")
        if n is None:
            assert not g["lps"], where
        else:
            assert len(g["lps"]) == len(r["lps"]) == len(g["ids"]), where
            for k, (a, b) in enumerate(zip(g["lps"], r["lps"], strict=True)):
                same_logprob(a, b, n, f"{where} logprob {k}")
    if "prompt_logprobs" in options:
        plps = [got[i]["plp"] for i in got if got[i]["plp"]]
        assert len(plps) == 1, f"{name}: prompt logprobs must come once, on one sequence"
        (ref_plp,) = [ref[i]["plp"] for i in ref if ref[i]["plp"]]
        assert len(plps[0]) == got[0]["final"].usage.prompt_tokens - 1 == len(ref_plp), name
        for k, (a, b) in enumerate(zip(plps[0], ref_plp, strict=True)):
            same_logprob(a, b, options["prompt_logprobs"], f"{name} prompt logprob {k}")
    return note


def gf_is_tool_calls(seq: dict) -> bool:
    from llmserve_proto.llmserve.v1 import generation_pb2 as gen

    return seq["final"].finish_reason in (gen.FINISH_REASON_TOOL_CALLS, gen.FINISH_REASON_LENGTH)


def test_concurrent_mixed_requests_equal_their_solo_runs(service, default_model_dir):
    with LLMServeClient(service.target, timeout=120) as client:
        solo = {name: run(client, name, words, opts, solo=True) for name, words, opts in REQUESTS}
        before = service.engine_stats().load
        mixed: dict[str, dict] = {}
        errors: list[BaseException] = []
        cancelled = threading.Event()

        def one(name, words, opts):
            try:
                mixed[name] = run(client, name, words, opts, solo=False)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def neighbour_that_cancels():
            stream = client.generate_stream(text_of(3, 60), temperature=0.7, max_tokens=200, logprobs=5)
            for k, _ in enumerate(stream):
                if k == 10:
                    stream.cancel()
                    cancelled.set()
                    return

        threads = [threading.Thread(target=one, args=r) for r in REQUESTS]
        threads.append(threading.Thread(target=neighbour_that_cancels))
        threads.append(threading.Thread(target=one, args=("greedy", 40, REQUESTS[0][2])))  # a twin, racing
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        errors = [
            e for e in errors if not (isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.CANCELLED)
        ]
        assert not errors, errors
        assert cancelled.is_set()
        after = service.engine_stats().load
    assert after.num_preemptions > before.num_preemptions, "the mix must preempt"
    assert after.prefix_hit_tokens > before.prefix_hit_tokens, "the mix must hit the prefix cache"
    notes = [compare(name, opts, mixed[name], solo[name]) for name, _, opts in REQUESTS]
    print("near-ties:", [n for n in notes if n])
    assert_engine_clean(service)

    # The offline API returns the same text for the same request (one text pipeline).
    from engine_svc import LLM

    llm = LLM(model=str(default_model_dir), num_kv_blocks=256)
    for name, words, opts in REQUESTS:
        if "tools" in opts:
            continue  # a chat: the offline API has no tool parser
        params = SamplingParams(**{k: v for k, v in opts.items() if k != "priority"})
        (offline,) = llm.generate([text_of(len(name), words)], params, use_tqdm=False)
        for c in offline.outputs:
            s = solo[name][c.index]
            assert c.token_ids == s["ids"], f"{name}[{c.index}]: offline tokens differ from the service's"
            assert c.text == s["text"], f"{name}[{c.index}]: offline text {c.text!r} vs service {s['text']!r}"
