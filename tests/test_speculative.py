"""Speculative decoding (n-gram prompt lookup and a draft model), verified in the normal step.

- Greedy and seeded requests get exactly the tokens they get without speculation (seeded rows draw
  their noise by position, so verification takes the very sample the plain run takes), across mixes
  with chunking, preemption, prefix hits and n > 1, for both proposers; drafts were made and
  accepted (every greedy one, with the target as its own draft model).
- Unseeded sampling keeps its distribution: token frequencies with and without speculation agree
  under a chi-square test, on a tiny vocabulary where drafts are often right and often wrong.
- Structured-output requests draft too, and get the plain engine's tokens.
- The pool is whole after every step (lookahead blocks of rejected drafts are released).
- A sequence whose drafts keep failing stops drafting; the governor drafts only where measured cheaper.
- Drafted/accepted counts reach usage (offline and through a service), Load and Prometheus; a
  request that opts out never drafts.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from engine_svc import SamplingParams
from engine_svc.kv_cache_manager import KVCacheManager
from engine_svc.scheduler import Scheduler
from engine_svc.spec_decode.config import SpeculativeConfig
from engine_svc.spec_decode.ngram import NgramIndex
from engine_svc.spec_decode.proposer import NgramProposer
from tests.differential import Result, assert_same_as_solo, drive, solo_params
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts
from tests.test_step_contract import add, fake_result, with_drafts

# Not adaptive: these tests count drafts, which must not depend on the machine's timing.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}


def run(model_dir, requests: dict, **opts) -> tuple[dict[str, Result], object]:
    engine = make_engine(model_dir, **opts)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    results: dict[str, Result] = {}
    drive(engine, results)
    assert_pool_whole(engine)
    return results, engine


def test_ngram_index_proposes_what_followed_the_latest_earlier_match():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 5, 6, 7]
    assert index.propose(tokens, 4) == [9, 5, 6, 7]  # "5 6 7" last seen before the suffix ending at 9
    assert index.propose([1, 2, 3], 4) == []
    # The earlier "4 4" ends one token back: the continuation runs into the end and goes on with period 1.
    assert NgramIndex(1, 2).propose([4, 4, 4], 3) == [4, 4, 4]
    # "7 8" last ended three tokens back: what followed it, "9 7 8", goes on with period 3.
    assert NgramIndex(2, 2).propose([1, 7, 8, 9, 7, 8], 5) == [9, 7, 8, 9, 7]


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory):
    """Random weights at HF's default scale: greedy decoding falls into short cycles, which gives
    n-gram lookup something to accept (as in the issue's benchmark model)."""
    from engine_svc.models.build import build_random_model

    return build_random_model(
        tmp_path_factory.mktemp("cycling") / "llama",
        "llama",
        seed=1,
        vocab_size=1024,
        initializer_range=0.02,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def truncated_draft(cycling_model, tmp_path_factory):
    """The cycling model's first layer alone: a draft that is often wrong (drafts get rejected)."""
    from tests.draft_models import build_truncated_model

    return build_truncated_model(cycling_model, tmp_path_factory.mktemp("draft") / "llama1", 1)


def speculation(method: str, cycling_model, truncated_draft) -> dict:
    if method == "ngram":
        return dict(NGRAM, max_batch=16)
    draft = cycling_model if method == "draft=target" else truncated_draft
    return {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 3,
        "max_batch": 16,
        "adaptive": False,
    }


@pytest.mark.parametrize("method", ["ngram", "draft=target", "draft=1 layer"])
@pytest.mark.parametrize("budget, blocks", [(512, 256), (24, 22)])
def test_greedy_and_seeded_tokens_equal_the_plain_engine(
    cycling_model, truncated_draft, method, budget, blocks
):
    base = random_prompts([6, 5, 7, 4, 9, 6], 1024, seed=31)
    prompts = [base[0] * 5, base[1] * 3, base[0] * 4 + base[2], base[3] * 6, base[4] * 2, base[0] * 5]
    params = [
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=50),
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=-3, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True, stop_token_ids=[11, 12, 13]),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    opts = dict(block_size=8, num_kv_blocks=blocks, max_num_batched_tokens=budget)
    plain, _ = run(
        cycling_model,
        {f"r{i}": (p, solo_params(sp)) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))},
        **opts,
    )
    requests = {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))}
    config = speculation(method, cycling_model, truncated_draft)
    spec, engine = run(cycling_model, requests, speculative_config=config, **opts)
    s = engine.scheduler
    assert s.num_drafted > 50 and s.num_accepted > 0, (s.num_drafted, s.num_accepted)
    if method != "draft=1 layer":
        assert s.num_accepted > 0.3 * s.num_drafted, (s.num_drafted, s.num_accepted)
    for rid, (_, sp) in requests.items():
        note = assert_same_as_solo(rid, spec[rid], plain[rid], sp)
        assert note is None or sp.greedy, note
    if budget == 24:
        assert engine.stats().num_preemptions > 0, "the small pool must preempt"
        assert engine.stats().prefix_hit_tokens > 0


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile at one-sided normal quantile z (3.09: alpha 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_unseeded_sampling_keeps_its_distribution(tmp_path, method):
    """A 12-token vocabulary: n-gram drafts are right often and wrong often. Token frequencies at
    each of the first output positions, over many samples, agree with and without speculation."""
    import torch

    from engine_svc.models.build import build_random_model

    model = build_random_model(
        tmp_path / "v12",
        "llama",
        seed=5,
        vocab_size=12,
        initializer_range=0.05,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    samples = 300
    counts = {}
    acceptance = None
    for mode in ("plain", "spec"):
        torch.manual_seed(123 if mode == "plain" else 321)
        opts = dict(block_size=8, num_kv_blocks=64 * 16, max_num_batched_tokens=2048, max_num_seqs=512)
        if mode == "spec":
            opts["speculative_config"] = (
                dict(NGRAM, max_batch=1024, min_acceptance=0.0)
                if method == "ngram"  # the model itself drafts, greedily: right often, wrong often
                else {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
                | {"max_batch": 1024, "min_acceptance": 0.0, "adaptive": False}
            )
        reqs = {
            f"s{i}": (prompt, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))
            for i in range(samples)
        }
        results, engine = run(model, reqs, **opts)
        counts[mode] = [Counter(r.outputs[0].tokens[pos] for r in results.values()) for pos in range(6)]
        if mode == "spec":
            s = engine.scheduler
            # Both paths must be exercised many times: accepted drafts and rejected ones.
            assert s.num_accepted >= 30 and s.num_drafted - s.num_accepted >= 30, (
                s.num_drafted,
                s.num_accepted,
            )
            acceptance = s.num_accepted / s.num_drafted
    for pos in range(1, 6):  # position 0 is never speculated: it is the prompt's sample
        a, b = counts["plain"][pos], counts["spec"][pos]
        tokens = sorted(set(a) | set(b))
        stat = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in tokens if a[t] + b[t] > 0)
        assert stat < chi_square_critical(len(tokens) - 1), (
            f"position {pos}: {a} vs {b} (acceptance {acceptance})"
        )


def test_a_sequence_whose_drafts_fail_stops_drafting():
    config = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, min_drafted=9
    )
    sched = make_sched(config)
    request = add(sched, "r", [5, 6, 5, 6, 5, 6], max_tokens=40)
    drafted = []
    for _ in range(30):
        out = sched.schedule()
        drafted.append(sum(len(d) for d in out.drafts.values()))
        result = fake_result(out)
        draft = out.drafts.get(request.sequences[0])
        if draft:  # the target disagrees at once (5 <-> 6), so the sequence stays a 5/6 cycle
            result.token_ids = [11 - draft[0]] * out.layout.num_sample_rows
        else:
            result.token_ids = [5] * out.layout.num_sample_rows
        sched.update_from_output(out, with_drafts(result, out, NgramProposer(config)))
        sched.check_invariants()  # rejected drafts' lookahead blocks are released at once
        if request.finished:
            break
    seq = request.sequences[0]
    assert seq.num_drafted >= 9 and seq.num_accepted == 0
    assert sum(drafted[-10:]) == 0, f"still drafting: {drafted}"


def test_drafts_are_bounded_by_max_tokens_and_the_budget():
    config = SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1, prompt_lookup_max=2)
    sched = make_sched(config, budget=3)
    request = add(sched, "r", [5, 6, 5, 6, 5, 6, 5, 6], max_tokens=4)
    seen = []
    while not request.finished:
        out = sched.schedule()
        seen.append(sum(out.num_new))
        # The fake target agrees with every draft: each step gains as many tokens as it verified.
        draft = next(iter(out.drafts.values()), [])
        tokens = draft + [7]
        layout = out.layout
        result = fake_result(out)
        if draft:
            result.token_ids = tokens[: layout.num_sample_rows]
            result.logprobs = [None] * layout.num_sample_rows
        sched.update_from_output(out, with_drafts(result, out, NgramProposer(config)))
    assert max(seen) <= 3, seen
    assert len(request.sequences[0].output_token_ids) == 4
    assert sched.kv.pool.num_used == 0


def test_a_draft_model_that_is_the_target_gets_every_greedy_draft_accepted(cycling_model):
    """The draft model's cache follows the target's blocks exactly (prefill chunks, forks, prefix
    hits): with the target itself as draft, every greedy draft is accepted, in a batch of requests
    with chunked prompts, a shared prefix and n = 2 greedy sequences."""
    base = random_prompts([9, 7, 5], 1024, seed=8)
    requests = {
        "a": (base[0] * 4, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)),
        "b": (base[0] * 4 + base[1], SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)),
        "c": (base[2] * 3, SamplingParams(n=2, temperature=0.0, max_tokens=33, ignore_eos=True)),
    }
    config = {
        "method": "draft_model",
        "model": str(cycling_model),
        "num_speculative_tokens": 4,
        "adaptive": False,
    }
    opts = dict(block_size=8, num_kv_blocks=128, max_num_batched_tokens=16)
    spec, engine = run(cycling_model, requests, speculative_config=config, **opts)
    plain, _ = run(cycling_model, requests, **opts)
    for rid in requests:
        assert spec[rid].outputs.keys() == plain[rid].outputs.keys()
        for i, out in spec[rid].outputs.items():
            assert out.tokens == plain[rid].outputs[i].tokens, (rid, i)
    s = engine.scheduler
    assert s.num_drafted > 80 and s.num_accepted == s.num_drafted, (s.num_drafted, s.num_accepted)
    assert engine.stats().prefix_hit_tokens > 0


def test_a_draft_model_with_another_vocabulary_is_refused(cycling_model, tmp_path):
    from engine_svc.models.build import build_random_model

    other = build_random_model(tmp_path / "v512", "llama", seed=2, vocab_size=512)
    config = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary has 512 tokens, the target's 1024"):
        make_engine(cycling_model, speculative_config=config)


def make_sched(spec: SpeculativeConfig, budget: int = 64) -> Scheduler:
    from engine_svc import EngineConfig

    config = EngineConfig(
        model="unused", block_size=8, max_num_batched_tokens=budget, speculative_config=spec
    )
    return Scheduler(config, KVCacheManager(64, 8, enable_prefix_caching=True), spec)


def test_bad_speculative_configs_are_refused(tiny_llama):
    for bad, match in [
        ({"method": "eagle"}, "method must be one of"),
        ({"method": "draft_model", "model": "/nonexistent"}, "not a loadable model directory"),
        ({"method": "draft_model"}, "'model' .* goes with method 'draft_model'"),
        ({"method": "ngram", "model": str(tiny_llama)}, "goes with method 'draft_model'"),
        ({"method": "ngram", "draft": 3}, "unknown keys"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ("ngram", "must be a dict"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_engine(tiny_llama, speculative_config=bad)
    random.seed(0)


def test_counts_reach_every_output_and_an_opted_out_request_never_drafts(cycling_model):
    """Per-output drafted/accepted counts (offline ``LLM``) equal an independent count taken from
    the schedules and the tokens each verification emitted; the engine's totals are their sum; a
    request with ``speculative=False`` drafts nothing and still gets the same tokens."""
    from engine_svc import LLM

    base = random_prompts([5, 7], 1024, seed=3)
    prompts = [base[0] * 6, base[1] * 4, base[0] * 6]
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, speculative=False),
    ]
    llm = LLM(cycling_model, block_size=8, num_kv_blocks=128, speculative_config=NGRAM)
    engine = llm.engine
    drafted: Counter = Counter()
    accepted: Counter = Counter()
    update = engine.scheduler.update_from_output

    def counting_update(out, result):
        deltas = update(out, result)
        by_seq = {s.request.request_id: len(d) for s, d in out.drafts.items()}
        for delta in deltas:  # no stop can cut a verification here: accepted = emitted - the bonus
            if delta.request_id in by_seq:
                drafted[delta.request_id] += by_seq[delta.request_id]
                accepted[delta.request_id] += len(delta.new_token_ids) - 1
        return deltas

    engine.scheduler.update_from_output = counting_update
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM(cycling_model, block_size=8, num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outs, plain, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        c = out.outputs[0]
        assert (c.num_draft_tokens, c.num_accepted_draft_tokens) == (
            drafted[out.request_id],
            accepted[out.request_id],
        ), out.request_id
        assert ref.num_draft_tokens == 0
    assert outs[0].num_draft_tokens > 20 and outs[0].num_accepted_draft_tokens > 0
    assert outs[2].num_draft_tokens == 0, "an opted-out request drafted"
    stats = engine.stats()
    assert stats.num_draft_tokens == sum(drafted.values())
    assert stats.num_accepted_draft_tokens == sum(accepted.values())
    with pytest.raises(ValueError, match="speculative must be True or False"):
        engine.add_request("bad", [1, 2], SamplingParams(speculative="no"))


def test_the_service_speculates_with_the_same_tokens(default_model_dir):
    """``llmserve serve --speculative-config``: greedy tokens equal a service without it; usage
    carries each sequence's drafted and accepted counts (none for ``speculative=False``), the
    engine's Load their totals, and Prometheus serves them (our names and vLLM's); a bad config
    stops the engine with exit 2 and the reason."""
    import subprocess
    import sys

    from gateway.client import LLMServeClient
    from tests.fault_helpers import metrics_port, wait_for
    from tests.service_process import ServiceProcess
    from tests.test_metrics import scrape

    prompt = "one two three one two three one two three one two"
    outs = []
    draft = json.dumps(
        {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3}
    )
    for extra in (
        [],
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        ["--speculative-config", draft],
    ):
        with ServiceProcess(
            default_model_dir,
            "--num-kv-blocks",
            "256",
            "--tokenizer-workers",
            "0",
            "--metrics-port",
            "0",
            *extra,
        ) as sp:
            with LLMServeClient(sp.target, timeout=60) as client:
                runs = [
                    client.generate(prompt, temperature=0.0, max_tokens=40, return_token_ids=True, **opt)
                    for opt in ({}, {"speculative": False})
                ]
            outs.append([list(r.token_ids) for r in runs])
            drafted = [r.usage.draft_tokens for r in runs]
            accepted = [r.usage.accepted_draft_tokens for r in runs]
            assert drafted[1] == accepted[1] == 0, "speculative=False drafted"
            assert (drafted[0] > 0) == bool(extra), drafted
            assert accepted[0] <= drafted[0]
            if "draft_model" in "".join(extra):  # the target as its own draft: greedy accepts all
                assert accepted[0] == drafted[0]
            load = sp.engine_stats().load
            assert (load.spec_draft_tokens, load.spec_accepted_tokens) == (drafted[0], accepted[0])
            port = metrics_port(sp)

            def heartbeat_arrived(port=port, want=drafted[0]):  # the figures come with heartbeats
                s = scrape(port)
                return s if s.get("vllm:spec_decode_num_draft_tokens_total") == want else None

            s = wait_for(heartbeat_arrived, 5.0, "the metrics did not reach the engine's drafted count")
            assert s["llmserve_spec_decode_draft_tokens_total"] == drafted[0]
            assert s["vllm:spec_decode_num_accepted_tokens_total"] == accepted[0]
            assert s["llmserve_spec_decode_accepted_tokens_total"] == accepted[0]
            rate = accepted[0] / drafted[0] if drafted[0] else 0.0
            assert abs(s["llmserve_spec_decode_acceptance_rate"] - rate) < 1e-9
    assert outs[0] == outs[1] == outs[2] and outs[0][0] == outs[0][1]
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine_svc.server",
            "--model",
            str(default_model_dir),
            "--speculative-config",
            '{"method": "x"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "method must be one of" in bad.stderr, bad.stderr[-500:]


@pytest.mark.parametrize("method", ["ngram", "draft=target"])
def test_structured_output_requests_draft_and_get_the_same_tokens(tiny_llama, method):
    """Constrained requests speculate: n-gram drafts are cut to what the grammar accepts, each draft
    position is masked by the matcher's state after the drafts before it, and the matcher advances
    by the verified tokens only. Greedy and seeded outputs equal the plain engine's and are valid;
    the draft model drafts without the grammar, and what it refuses is rejected at verification
    (the rows after a refused draft are left unmasked and never used)."""
    from engine_svc import StructuredOutputsParams
    from tests.test_structured_outputs import GRAMMAR, SCHEMA, matcher_accepts

    specs = {
        "regex": StructuredOutputsParams(regex="(abc,|de;)+"),
        "json": StructuredOutputsParams(json={"type": "array", "items": {"enum": ["ab", "cd"]}}),
        "schema": StructuredOutputsParams(json=SCHEMA),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    }
    (prompt,) = random_prompts([7], 512, seed=12)
    requests = {}
    for kind, so in specs.items():
        requests[f"{kind}/greedy"] = (
            prompt,
            SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=so),
        )
        requests[f"{kind}/seeded"] = (
            prompt,
            SamplingParams(temperature=0.8, seed=5, max_tokens=48, structured_outputs=so),
        )
    if method == "ngram":
        config = dict(NGRAM, max_batch=16, min_acceptance=0.0)
    else:
        config = {
            "method": "draft_model",
            "model": str(tiny_llama),
            "num_speculative_tokens": 3,
            "max_batch": 16,
            "adaptive": False,
        }
    opts = dict(block_size=8, num_kv_blocks=256, max_num_batched_tokens=64)
    plain, _ = run(tiny_llama, {rid: (p, solo_params(sp)) for rid, (p, sp) in requests.items()}, **opts)
    spec, engine = run(tiny_llama, requests, speculative_config=config, **opts)
    s = engine.scheduler
    assert s.num_drafted > 40, s.num_drafted
    if method == "ngram":  # drafts cut to what the grammar accepts are often right
        assert s.num_accepted > 10, (s.num_drafted, s.num_accepted)
    else:  # the target's unconstrained argmax is rarely what the grammar allows
        assert s.num_accepted < s.num_drafted, "no draft was refused: the refused-draft path is untested"
    for rid, (_, sp) in requests.items():
        note = assert_same_as_solo(rid, spec[rid], plain[rid], sp)
        assert note is None or sp.greedy, note
        out = spec[rid].outputs[0]
        tokens = out.tokens[:-1] if out.stop_token_id is not None else out.tokens  # EOS is not text
        assert matcher_accepts(
            tiny_llama, specs[rid.split("/")[0]], tokens, whole=out.finish_reason == "stop"
        )


def test_the_governor_drafts_only_at_batch_sizes_where_drafting_is_cheaper():
    """Per batch size, seconds per emitted token with and without drafts decide; the other choice
    is retried every ``explore_every`` steps, and sizes are judged apart."""
    from engine_svc.spec_decode.governor import SpeculationGovernor

    g = SpeculationGovernor(explore_every=4)
    assert g.allow(1) is True  # nothing measured: try drafting first
    g.record(1, True, seconds=0.010, tokens=3)  # 3.3 ms per token with drafts
    assert g.allow(1) is False  # then without
    g.record(1, False, seconds=0.008, tokens=1)  # 8 ms per token without
    assert [g.allow(1) for _ in range(6)] == [True, False, True, True, True, False]  # steps 4, 8 explore
    g.record(4, True, seconds=0.060, tokens=8)  # 7.5 ms per token at batch 4 with drafts
    g.record(4, False, seconds=0.020, tokens=4)  # 5 ms without
    assert [g.allow(4) for _ in range(4)] == [False, False, False, True]
    for _ in range(20):  # batch 1 gets slow with drafts (acceptance fell): the average follows
        g.record(1, True, seconds=0.030, tokens=2)
    assert g.allow(1) is False


def test_the_scheduler_stops_drafting_where_the_governor_measured_it_slower():
    config = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, adaptive=True
    )
    sched = make_sched(config)
    request = add(sched, "r", [5, 6, 5, 6, 5, 6], max_tokens=60)
    drafted = []
    for _ in range(40):
        out = sched.schedule()
        drafted.append(bool(out.drafts))
        result = fake_result(out)
        draft = next(iter(out.drafts.values()), [])
        tokens = (draft + [7])[: out.layout.num_sample_rows] if draft else result.token_ids
        result.token_ids, result.logprobs = tokens, [None] * len(tokens)
        deltas = sched.update_from_output(out, with_drafts(result, out, NgramProposer(config)))
        # Drafted steps: 4 tokens in 40 ms (10 ms each); plain steps: 1 token in 5 ms.
        sched.note_step_time(out, 0.040 if out.drafts else 0.005, deltas)
        if request.finished:
            break
    assert any(drafted[:5]), drafted  # it tried
    later = drafted[5:]
    assert sum(later) <= len(later) // 16 + 1, drafted  # only the governor's exploring steps draft


def test_a_corpus_is_looked_up_first_at_each_length_and_read_forwards():
    """An earlier output (the corpus) proposes what followed the suffix there before the sequence's
    own latest match of the same length; a longer own match still wins; within the corpus the
    occurrence at or after the last one drafted from is taken; without a corpus nothing changes."""
    corpus = [1, 2, 3, 4, 1, 2, 7, 8, 9]
    tokens = [5, 1, 2, 6, 6, 9, 1, 2]  # "1 2": own latest match is followed by 6; the corpus's by 3
    assert NgramIndex(2, 3, corpus).propose(tokens, 3) == [3, 4, 1]
    assert NgramIndex(2, 3).propose(tokens, 3) == [6, 6, 9]
    # "9 1 2" occurred in the sequence (3 tokens), the corpus has only "1 2": the longer match wins
    own = [9, 1, 2, 5, 5, 9, 1, 2]
    assert NgramIndex(2, 3, corpus).propose(own, 2) == [5, 5]
    # read forwards: after drafting from the corpus's first "1 2" (at 2), the next "1 2" lookup takes
    # the occurrence at or after it: the first again; a later cursor takes the later one
    index = NgramIndex(2, 2, corpus)
    assert index.propose([0, 3, 4, 1, 2], 2) == [3, 4]  # "1 2" -> corpus position 2 (its first)
    assert index.propose([0, 3, 4, 1, 2, 3, 4], 3) == [1, 2, 7]  # "3 4" -> position 4 (at/after 2)
    assert index.propose([0, 3, 4, 1, 2, 3, 4, 1, 2], 3) == [7, 8, 9]  # "1 2" at/after 4: position 6
    # an n-gram at the corpus's very end proposes nothing from it (the sequence's own lookup then)
    assert NgramIndex(2, 2, [4, 8, 9]).propose([8, 9, 3, 8, 9], 2) == [3, 8]


def test_shared_prefix_agrees_with_a_scan():
    from engine_svc.spec_decode.ngram import shared_prefix

    rng = random.Random(5)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert shared_prefix(a, b) == n == shared_prefix(b, a)


def test_recent_outputs_serve_a_prompt_that_begins_as_theirs_within_one_tenant():
    """The corpus is the output (after the last ``tail`` prompt tokens) of the entry whose prompt
    shares the most with the new one, at least half of it, in the same (tenant, adapter) group;
    the latest wins a tie; the memory holds ``capacity`` entries and never an empty output."""
    from engine_svc.spec_decode.ngram import RecentOutputs

    recent = RecentOutputs(capacity=3, tail=2)
    prompt = list(range(100, 120))
    recent.add((0, 0), 20, prompt + [1, 2, 3])
    recent.add((0, 0), 20, prompt + [])  # nothing generated: not kept
    assert len(recent.entries) == 1
    assert recent.corpus((0, 0), prompt + [1]) == [118, 119, 1, 2, 3]
    assert recent.corpus((5, 0), prompt + [1]) == []  # another tenant
    assert recent.corpus((0, 1), prompt + [1]) == []  # another adapter
    assert recent.corpus((0, 0), prompt[:9] + [0] * 12) == []  # 9 of 21 shared: under half
    assert recent.corpus((0, 0), prompt[:11] + [0] * 10) == [118, 119, 1, 2, 3]  # 11 of 21
    recent.add((0, 0), 20, prompt + [4, 5])  # the same prompt again: the latest wins the tie
    assert recent.corpus((0, 0), prompt) == [118, 119, 4, 5]
    longer = prompt + [7, 7]
    recent.add((0, 0), 22, longer + [6])  # shares more with a prompt that has the 7s
    assert recent.corpus((0, 0), longer + [8]) == [7, 7, 6]
    for n in (1, 2, 3):  # three more: the first three are gone
        recent.add((0, 0), 20, prompt + [9] * n)
    assert len(recent.entries) == 3 and recent.corpus((0, 0), longer + [8]) == [118, 119, 9, 9, 9]


def test_a_later_request_drafts_from_an_earlier_output_of_its_tenant(cycling_model):
    """B's prompt is A's with A's first three tokens after it (an editor's next keystroke, in
    tokens): B's greedy output is A's from its fourth token, so with A's output as its corpus B's
    drafts are accepted from its first verification on. Drafted from a fresh engine, or after A
    of another tenant, B drafts only from its own tokens. Its tokens are the plain engine's in all
    three; the counts are the engine's own (RequestDelta)."""
    spec = dict(NGRAM, prompt_lookup_min=2, prompt_lookup_max=3)
    prompt_a = random_prompts([48], 1024, seed=11)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = run(cycling_model, {"a": (prompt_a, greedy)})
    out_a = plain["a"].outputs[0].tokens
    prompt_b = prompt_a + out_a[:3]
    b_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def b_after(first_salt: str | None, b_salt: str | None):
        engine = make_engine(cycling_model, speculative_config=spec)
        counts = []
        results: dict[str, Result] = {}
        if first_salt != "none":
            engine.add_request("a", prompt_a, greedy, cache_salt=first_salt)
            drive(engine, results)
        engine.add_request("b", prompt_b, b_params, cache_salt=b_salt)
        while engine.has_unfinished_requests():
            for d in engine.step():
                results.setdefault(d.request_id, Result()).add(d)
                counts.append((d.num_draft_tokens, d.num_accepted_draft_tokens))
        assert_pool_whole(engine)
        assert results["b"].outputs[0].tokens == out_a[3:33]
        return counts[-1]

    fresh = b_after("none", None)
    shared = b_after(None, None)
    other_tenant = b_after("tenant-a", "tenant-b")
    assert other_tenant == fresh  # nothing crossed between tenants
    drafted, accepted = shared
    assert accepted >= 20 and accepted > fresh[1], (shared, fresh)
    assert drafted - accepted <= 4, shared  # only the drafts past A's output miss


def test_a_sequence_on_a_streak_drafts_where_the_governor_average_would_not():
    """The governor's average cost per token over drafted steps says no (20 ms a token against
    10 ms plain), but a drafted step that emits all k + 1 tokens costs 5 ms a token: a sequence
    whose drafts were all accepted drafts again after every step, until one is rejected; then only
    the governor's exploring steps draft. Where a full step would not pay either, no streak
    drafts (the governor test above: 40 ms for 4 tokens against 5 ms plain)."""
    config = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2, adaptive=True
    )
    sched = make_sched(config)
    sched.governor.record(1, True, seconds=0.020, tokens=1)  # 20 ms a token, 20 ms a step
    sched.governor.record(1, False, seconds=0.010, tokens=1)
    assert sched.governor.full_drafts_pay(1, 4) and not sched.governor.full_drafts_pay(1, 2)
    request = add(sched, "r", [5, 6, 5, 6, 5, 6], max_tokens=400)
    drafted, reject_from = [], 15
    for step in range(70):
        out = sched.schedule()
        drafted.append(bool(out.drafts))
        result = fake_result(out)
        draft = next(iter(out.drafts.values()), [])
        if draft and step < reject_from:  # the target agrees with every draft: a copy
            tokens = (draft + [5 if draft[-1] == 6 else 6])[: out.layout.num_sample_rows]
        elif draft:  # it disagrees at once
            tokens = ([11 - draft[0]] + [5] * 8)[: out.layout.num_sample_rows]
        else:
            tokens = [5 if request.sequences[0].token_ids[-1] == 6 else 6] * out.layout.num_sample_rows
        result.token_ids, result.logprobs = tokens, [None] * len(tokens)
        sched.update_from_output(out, with_drafts(result, out, NgramProposer(config)))
        if request.finished:
            break
    # the prompt's first sampled token: a new sequence is on a streak; then every step drafts
    assert all(drafted[1:reject_from]), drafted
    later = drafted[reject_from + 2 :]
    assert later and sum(later) <= len(later) // 16 + 1, drafted  # the governor's exploring steps
