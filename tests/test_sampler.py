"""The sampler against plain per-row reference computations on fixed logits, and seeded sampling
reproducible whatever else shares the batch."""

from __future__ import annotations

import math

import pytest
import torch

from engine_svc import SamplingParams
from engine_svc.logits_processors.min_tokens import MinTokens
from engine_svc.logits_processors.penalties import apply_penalties
from engine_svc.sampler import Sampler, SamplingBatch, filter_logits
from tests.engine_helpers import make_engine, random_prompts, run_to_completion


def _batch(rows: int, **cols) -> SamplingBatch:
    def t(name, default, dtype=torch.float32):
        return torch.tensor(cols.get(name, [default] * rows), dtype=dtype)

    return SamplingBatch(
        temperature=t("temperature", 1.0),
        top_k=t("top_k", 0, torch.int64),
        top_p=t("top_p", 1.0),
        min_p=t("min_p", 0.0),
        repetition_penalty=t("repetition_penalty", 1.0),
        presence_penalty=t("presence_penalty", 0.0),
        frequency_penalty=t("frequency_penalty", 0.0),
        noise_keys=cols.get("noise_keys", [None] * rows),
        num_logprobs=cols.get("num_logprobs", [None] * rows),
        all_greedy=False,
        processors=cols.get("processors", []),
    )


def _reference_keep(logits_row: list[float], k: int, p: float, min_p: float) -> set[int]:
    order = sorted(range(len(logits_row)), key=lambda i: -logits_row[i])
    kept = order[:k] if k > 0 else order
    z = sum(math.exp(logits_row[i]) for i in kept)
    probs = {i: math.exp(logits_row[i]) / z for i in kept}
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= p and nucleus:
            break
        nucleus.append(i)
        mass += probs[i]
    top = probs[kept[0]]
    return {i for i in nucleus if probs[i] >= min_p * top or i == kept[0]}


@pytest.mark.parametrize(
    "k,p,min_p",
    [
        (0, 1.0, 0.0),
        (3, 1.0, 0.0),
        (0, 0.6, 0.0),
        (5, 0.8, 0.0),
        (0, 1.0, 0.3),
        (4, 0.9, 0.1),
        (1, 0.5, 0.0),
        (0, 0.05, 0.0),
    ],
)
def test_filters_match_reference(k, p, min_p):
    gen = torch.Generator().manual_seed(k * 100 + int(p * 10))
    logits = torch.randn(6, 12, generator=gen) * 2
    rows = logits.shape[0]
    masked = filter_logits(
        logits.clone(), torch.full((rows,), k), torch.full((rows,), p), torch.full((rows,), min_p)
    )
    for r in range(rows):
        kept = {i for i in range(12) if masked[r, i] != float("-inf")}
        assert kept == _reference_keep(logits[r].tolist(), k, p, min_p)


def test_penalties_match_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    b = _batch(
        2,
        repetition_penalty=[1.5, 1.0],
        presence_penalty=[0.0, 0.5],
        frequency_penalty=[0.0, 0.25],
    )
    got = apply_penalties(logits.clone(), b, [[0, 0, 1], [2, 2, 2, 4]], [[3], [0]])
    expected = logits.clone()
    for tok in (0, 1, 3):  # row 0: repetition over prompt and output tokens
        v = expected[0, tok]
        expected[0, tok] = v / 1.5 if v > 0 else v * 1.5
    expected[1, 2] -= 0.5 + 0.25 * 3  # row 1: presence once, frequency per occurrence
    expected[1, 4] -= 0.5 + 0.25 * 1
    torch.testing.assert_close(got, expected)


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0]]).repeat(4000, 1)
    b = _batch(4000, temperature=[0.8] * 4000, top_k=[3] * 4000)
    tokens, _ = Sampler()(logits.clone(), b)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float() / 4000
    expected = torch.zeros(5)
    expected[[0, 1, 3]] = (torch.tensor([1.0, 2.0, 3.0]) / 0.8).softmax(0)
    assert counts[2] == 0 and counts[4] == 0
    assert (counts - expected).abs().max() < 0.03


def test_banned_tokens_and_logprobs():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 1.0, 5.0]])
    # A ban is an adjustment: applied after the logprobs are read (they report what was possible).
    b = _batch(2, temperature=[0.0, 0.0], processors=[(MinTokens(), [[0], []])], num_logprobs=[2, 0])
    tokens, lps = Sampler()(logits.clone(), b)
    assert tokens == [1, 2]
    ref = logits.log_softmax(-1)
    assert lps[0].token_id == 1 and lps[0].rank == 2 and abs(lps[0].logprob - float(ref[0, 1])) < 1e-6
    assert lps[0].top_ids == [0, 1]
    assert lps[1].rank == 1 and lps[1].top_ids == []


def test_seeded_sampling_is_independent_of_batch_mix(tiny_llama):
    prompts = random_prompts([4, 20, 9, 33], 1024, seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = run_to_completion(make_engine(tiny_llama), {"s": (prompts[0], seeded)})
    others = {
        str(i): (p, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
        for i, p in enumerate(prompts[1:])
    }
    mixed = run_to_completion(
        make_engine(tiny_llama, max_num_batched_tokens=16), {**others, "s": (prompts[0], seeded)}
    )
    assert alone[("s", 0)] == mixed[("s", 0)]
    other_seed = run_to_completion(
        make_engine(tiny_llama),
        {
            "s": (
                prompts[0],
                SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12, ignore_eos=True),
            )
        },
    )
    assert other_seed[("s", 0)] != alone[("s", 0)]


def test_a_row_that_bans_take_the_last_allowed_token_from_is_a_dead_end_not_token_0():
    """Row 0 may sample only token 2 (allowed ids), and min_tokens bans 2 now; row 1 may sample only
    2 and 1, and a bad word bans both. Neither has a token left once every control is applied: both
    are dead ends (never token 0, which argmax over all -inf would give), and their logprobs are
    not reported; row 2, banned only one of its tokens, samples as before."""
    from engine_svc.logits_processors.allowed_ids import AllowedIds
    from engine_svc.logits_processors.bad_words import BadWords
    from engine_svc.sampler import DEAD_END_TOKEN

    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0], [0.0, 1.0, 5.0, 2.0], [0.0, 1.0, 5.0, 2.0]])
    processors = [
        (AllowedIds(), [[2], [1, 2], None]),
        (MinTokens(), [[2], [], []]),
        (BadWords(), [[], [1, 2], [2]]),
    ]
    for temperature in (0.0, 1.0):
        b = _batch(3, temperature=[temperature] * 3, processors=processors, num_logprobs=[1, 1, 1])
        tokens, lps = Sampler()(logits.clone(), b)
        assert tokens[:2] == [DEAD_END_TOKEN, DEAD_END_TOKEN]
        assert lps[:2] == [None, None]
        assert tokens[2] != 2 and (temperature or tokens[2] == 3)


def test_a_row_without_filters_keeps_every_token():
    # One dominant logit: in fp32 the mass before every tail token rounds to exactly 1.0, which a
    # top_p of 1.0 compared with ">=" would drop; a row that asks for no filter is not filtered.
    logits = torch.tensor([[30.0] + [0.0] * 1000])
    masked = filter_logits(logits.clone(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.equal(masked, logits)


def test_mixed_filters_in_one_batch_each_row_as_alone():
    gen = torch.Generator().manual_seed(7)
    vocab = 50
    settings = [
        (0, 1.0, 0.0),
        (3, 1.0, 0.0),
        (0, 0.6, 0.0),
        (5, 0.8, 0.1),
        (3, 0.9, 0.0),
        (0, 1.0, 0.3),
        (60, 1.0, 0.0),
    ]
    logits = torch.randn(len(settings), vocab, generator=gen) * 2
    k, p, m = (torch.tensor(col) for col in zip(*settings, strict=True))
    together = filter_logits(logits.clone(), k, p, m)
    for r, (kr, pr, mr) in enumerate(settings):
        alone = filter_logits(logits[r : r + 1].clone(), k[r : r + 1], p[r : r + 1], m[r : r + 1])
        assert torch.equal(together[r], alone[0])
        kept = {i for i in range(vocab) if together[r, i] != float("-inf")}
        assert kept == _reference_keep(logits[r].tolist(), kr if kr < vocab else 0, pr, mr)


def test_rows_the_partial_ranking_cannot_settle_are_ranked_whole(monkeypatch):
    import engine_svc.sampler as sampler

    monkeypatch.setattr(sampler, "PARTIAL_RANKS", 8)
    gen = torch.Generator().manual_seed(11)
    vocab = 300
    peaked = torch.randn(vocab, generator=gen) * 6  # top-p 0.9 settled within the best 8
    flat = torch.randn(vocab, generator=gen) * 0.1  # needs far more than 8 tokens
    settings = [
        (peaked, 0.9, 0.0),
        (flat, 0.9, 0.0),
        (flat, 1.0, 0.5),
        (peaked, 1.0, 0.01),
        (flat, 0.02, 0.0),
    ]
    logits = torch.stack([row for row, _, _ in settings])
    p = torch.tensor([s[1] for s in settings])
    m = torch.tensor([s[2] for s in settings])
    masked = filter_logits(logits.clone(), torch.zeros(len(settings), dtype=torch.int64), p, m)
    sizes = []
    for r, (row, pr, mr) in enumerate(settings):
        kept = {i for i in range(vocab) if masked[r, i] != float("-inf")}
        assert kept == _reference_keep(row.tolist(), 0, pr, mr)
        sizes.append(len(kept))
    assert sizes[0] <= 8 and sizes[1] > 8 and sizes[2] > 8  # both paths taken
