"""Embedding requests in the engine (engine_svc/pooling.py), on a tiny random Llama.

Checked against an independent reader, HF transformers' last hidden state (after the final norm),
for "last" and "mean" pooling, normalised or not; and differentially: each embedding request of a
mix (embedding and generation requests sharing steps, a small token budget so prompts are chunked,
shared prefixes so prefix hits happen) gives the same bytes as its solo run on a fresh engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc import LLM, SamplingParams
from engine_svc.pooling import decode_vector
from tests.differential import Result, assert_same_as_solo, drive, solo
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts

VOCAB = 1024


def embed_params(pooling: str = "last", normalize: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling, normalize=normalize)


def embeddings(engine, prompts: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, bytes]:
    for rid, (prompt, params) in prompts.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, bytes] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.embedding is not None:
                assert d.request_finished and rid not in got
                got[d.request_id] = d.embedding
        engine.check_invariants()
    return got


@pytest.fixture(scope="module")
def hf_llama(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_vector_is_the_pooled_final_hidden_state(tiny_llama, hf_llama, pooling, normalize):
    prompts = random_prompts([1, 7, 40], VOCAB, seed=3)
    engine = make_engine(tiny_llama, max_num_batched_tokens=16)  # 40 tokens: three chunks
    got = embeddings(engine, {f"r{i}": (p, embed_params(pooling, normalize)) for i, p in enumerate(prompts)})
    assert_pool_whole(engine)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf_llama(torch.tensor([prompt]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0]  # after the final norm
        ref = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        if normalize:
            ref = ref / ref.norm()
        vec = decode_vector(got[f"r{i}"])
        assert vec.shape == (hf_llama.config.hidden_size,)
        np.testing.assert_allclose(vec, ref.numpy(), rtol=1e-4, atol=1e-5)
        if normalize:
            assert abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5


def test_embedding_requests_are_their_solo_run_in_a_mix(tiny_llama):
    """Bitwise: embeddings and generations share steps, prompts are chunked (budget 24), a prompt
    repeats an earlier one whole and another shares its prefix (prefix hits, "last" pooling), and
    every vector equals its solo run's bytes; generations equal their solo runs too."""
    make = lambda: make_engine(tiny_llama, max_num_batched_tokens=24, num_kv_blocks=64)  # noqa: E731
    p = random_prompts([30, 50, 3, 65], VOCAB, seed=11)
    mix = {
        "e-last": (p[0], embed_params("last")),
        "e-mean": (p[1], embed_params("mean")),
        "g-1": (p[2], SamplingParams(max_tokens=12, temperature=0.0)),
        "e-raw": (p[3], embed_params("last", normalize=False)),
        "e-repeat": (p[0], embed_params("last")),  # the whole prompt again: a prefix hit
        "e-prefix": (p[0][:20] + p[2], embed_params("mean")),  # shares a block with e-last
        "g-2": (p[1][:40], SamplingParams(max_tokens=8, temperature=0.7, seed=5)),
    }
    engine = make()
    results: dict[str, Result] = {}
    added = list(mix.items())
    for rid, (prompt, params) in added[:4]:
        engine.add_request(rid, prompt, params)

    def later(step):
        if step == 2:  # arrive mid-run: e-last's first blocks are cached by now
            for rid, (prompt, params) in added[4:]:
                engine.add_request(rid, prompt, params)

    drive(engine, results, on_step=later)
    assert_pool_whole(engine)
    assert engine.stats().prefix_hit_tokens > 0, "no prefix hit happened: the test lost its point"
    for rid, (prompt, params) in mix.items():
        ref = solo(make, prompt, params)
        assert (ref.embedding is None) == (params.pooling is None), rid
        assert_same_as_solo(rid, results[rid], ref, params)
    assert results["e-repeat"].embedding == results["e-last"].embedding


def test_llm_embed_alone_and_together(tiny_llama):
    """The offline ``LLM.embed``: each prompt's vector is the bytes it gets alone (text and token-id
    prompts; a fresh engine per call, so nothing is cached across them)."""
    prompts = random_prompts([9, 33, 5], VOCAB, seed=5)
    together = LLM(model=str(tiny_llama), max_num_batched_tokens=32).embed(prompts + ["a text prompt"])
    for i, prompt in enumerate(prompts + ["a text prompt"]):
        (alone,) = LLM(model=str(tiny_llama)).embed(prompt)
        assert alone.dtype == np.float32 and alone.tobytes() == together[i].tobytes(), i
    (mean,) = LLM(model=str(tiny_llama)).embed(prompts[1], pooling="mean", normalize=False)
    assert not np.array_equal(mean, together[1]) and abs(float(np.linalg.norm(mean)) - 1) > 1e-3


def test_embedding_params_are_checked():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=4, pooling="last").validate(VOCAB)
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(max_tokens=1, pooling="cls").validate(VOCAB)
    with pytest.raises(ValueError, match="normalize"):
        SamplingParams(max_tokens=1, pooling="mean", normalize="yes").validate(VOCAB)


def test_an_embedding_request_samples_no_token(tiny_llama):
    """An embedding request computes its prompt and ends: no logits row, no sampled token, no decode
    step (a sampler spy, with the model's greedy tokens, and the model's logits both see only the
    generation beside it)."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=16)
    runner = engine.runner
    sampled, logit_rows = [], []
    sampler, compute_logits = runner.sampler, runner.forward.model.compute_logits

    def spy_sampler(logits, batch):
        sampled.append(len(logits))
        return sampler(logits, batch)

    def spy_logits(hidden):
        logit_rows.append(len(hidden))
        return compute_logits(hidden)

    greedy_tokens = runner.forward.model.greedy_tokens

    def spy_greedy(hidden):  # all-greedy rows: their argmax from the model, no sampler call
        sampled.append(len(hidden))
        return greedy_tokens(hidden)

    runner.sampler, runner.forward.model.compute_logits = spy_sampler, spy_logits
    runner.forward.model.greedy_tokens = spy_greedy
    p = random_prompts([40, 9, 12], VOCAB, seed=21)
    engine.add_request("e-last", p[0], embed_params("last"))
    engine.add_request("e-mean", p[1], embed_params("mean"))
    steps = 0
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
        steps += 1
    assert sampled == [] and logit_rows == [], "an embedding request sampled or made logits"
    assert steps == 4  # 49 prompt tokens in steps of 16: no step after the prompts
    assert all(d.new_token_ids == [] and d.finish_reason == "stop" for d in deltas)
    assert {d.request_id for d in deltas if d.embedding is not None} == {"e-last", "e-mean"}
    assert engine.num_generation_tokens == 0
    # beside a generation: only its rows are sampled
    engine.add_request("e-again", p[2], embed_params("last"))
    engine.add_request("g", p[1], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(sampled) == 3 == engine.num_generation_tokens
    assert_pool_whole(engine)
