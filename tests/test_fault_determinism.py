"""A seed fixes the tokens: alone, in a batch with other requests, and after a restart of the whole
service."""

from __future__ import annotations

import asyncio
import random

from gateway.client import LLMServeClient, build_request
from tests.fault_helpers import assert_engine_clean, stop_and_check, stream_all, token_ids_of
from tests.service_process import ServiceProcess

SEEDED = [
    dict(prompt="The seed decides", max_tokens=24, temperature=0.9, top_k=50, seed=1234, ignore_eos=True),
    dict(prompt="Another seeded one", max_tokens=24, temperature=1.2, top_p=0.9, seed=7, ignore_eos=True),
    dict(prompt="Two of them", n=2, max_tokens=16, temperature=1.0, seed=99, ignore_eos=True),
]


def _seeded_alone(sp: ServiceProcess) -> list[list[list[int]]]:
    out = []
    with LLMServeClient(sp.target, timeout=60) as c:
        for opts in SEEDED:
            r = c.generate(return_token_ids=True, **opts)
            out.append([list(s.token_ids) for s in [r, *r.additional_sequences]])
    return out


def _seeded_in_a_crowd(sp: ServiceProcess, crowd_seed: int) -> list[list[list[int]]]:
    rng = random.Random(crowd_seed)
    crowd = [
        build_request(
            f"noise {i} " * rng.randint(1, 30),
            max_tokens=rng.randint(4, 40),
            temperature=rng.choice([0.0, 0.7, 1.5]),
            ignore_eos=True,
        )
        for i in range(8)
    ]
    seeded = [build_request(return_token_ids=True, **opts) for opts in SEEDED]
    mixed = crowd[:4] + seeded + crowd[4:]
    results = asyncio.run(stream_all(sp.target, mixed))
    out = []
    for opts, msgs in zip(SEEDED, results[4 : 4 + len(SEEDED)], strict=True):
        n = opts.get("n", 1)
        out.append([token_ids_of([m for m in msgs if m.index == i]) for i in range(n)])
    return out


def test_same_seed_same_tokens_across_batch_mixes_and_restarts(tiny_llama):
    args = ("--num-kv-blocks", "256", "--tokenizer-workers", "1", "--max-num-batched-tokens", "64")
    sp = ServiceProcess(tiny_llama, *args).start()
    try:
        alone = _seeded_alone(sp)
        assert all(len(seq) > 0 for req in alone for seq in req)
        assert alone[2][0] != alone[2][1]  # n=2: each sequence has its own stream of randomness
        assert _seeded_in_a_crowd(sp, 1) == alone
        assert _seeded_in_a_crowd(sp, 2) == alone
        assert_engine_clean(sp)
        stop_and_check(sp)
    finally:
        sp.kill()
    sp = ServiceProcess(tiny_llama, *args).start()  # a fresh engine and gateway
    try:
        assert _seeded_alone(sp) == alone
        assert _seeded_in_a_crowd(sp, 3) == alone
        assert_engine_clean(sp)
        stop_and_check(sp)
    finally:
        sp.kill()
