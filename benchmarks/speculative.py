"""Speculative decoding (n-gram prompt lookup): what it gives and what it costs, in one run.

Random-weight models fall into repeated cycles under greedy decoding, which gives n-gram lookup
something to accept; each figure comes with its measured acceptance rate.

- Batch 1 and concurrency 4, long greedy outputs: time per output token with speculation vs
  without (target >= 1.5x where acceptance >= 0.6).
- Drafts that are never right (a target that samples at a high temperature, whose continuations the
  prompt never predicts): no more than 5% slower than without (the off switch works).
- Concurrency 16 throughput: no worse than -5% (above ``max_batch`` nobody drafts).
Runs alternate: without, with, without, with.
"""

from __future__ import annotations

import time

from benchmarks import common
from engine_svc import SamplingParams

FULL = dict(prompt_len=64, max_tokens=256, repeats=2, k=4)
QUICK = dict(prompt_len=16, max_tokens=32, repeats=1, k=3)
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def run(engine, prompts, params) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
    drafted0, accepted0 = engine.scheduler.num_drafted, engine.scheduler.num_accepted
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    wall = time.perf_counter() - t0
    drafted = engine.scheduler.num_drafted - drafted0
    accepted = engine.scheduler.num_accepted - accepted0
    engine.kv.pool.reset_prefix_cache()
    return dict(tok_s=tokens / wall, acceptance=accepted / drafted if drafted else 0.0, drafted=drafted)


def compare(model, w, batch: int, params: SamplingParams, seed: int) -> dict:
    plain = common.make_engine(model, num_kv_blocks=4096)
    spec = common.make_engine(
        model, num_kv_blocks=4096, speculative_config=dict(NGRAM, num_speculative_tokens=w["k"])
    )
    for e in (plain, spec):
        common.warm_up(e)
    import random

    rng = random.Random(seed)
    prompts = [
        common.random_prompt(rng, w["prompt_len"], common.vocab_size(w is QUICK)) for _ in range(batch)
    ]
    ratios, acc, drafted = [], [], []
    for _ in range(w["repeats"]):
        a = run(plain, prompts, params)
        b = run(spec, prompts, params)
        ratios.append(b["tok_s"] / a["tok_s"])
        acc.append(b["acceptance"])
        drafted.append(b["drafted"])
    return dict(speedup=min(ratios), ratios=ratios, acceptance=sum(acc) / len(acc), drafted=drafted)


def main() -> dict:
    args, t_start, w, model = common.begin(__doc__, FULL, QUICK)
    greedy = SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)
    hot = SamplingParams(temperature=5.0, seed=1, max_tokens=w["max_tokens"], ignore_eos=True)
    figures = {
        "batch1_greedy": compare(model, w, 1, greedy, 1),
        "concurrency4_greedy": compare(model, w, 4, greedy, 2),
        "batch1_never_right": compare(model, w, 1, hot, 3),
        "concurrency16_greedy": compare(model, w, 16, greedy, 4),
    }
    for name, f in figures.items():
        runs = [round(r, 2) for r in f["ratios"]]
        acceptance = f["acceptance"]
        print(f"{name}: {f['speedup']:.2f}x ({runs}), acceptance {acceptance:.2f}, drafts {f['drafted']}")
    b1 = figures["batch1_greedy"]
    targets = [
        common.target(
            f"batch 1, greedy: speed with speculation (acceptance {b1['acceptance']:.2f})",
            b1["speedup"],
            ">=",
            1.5,
            "x",
            note="judged where acceptance >= 0.6"
            if b1["acceptance"] >= 0.6
            else "acceptance below 0.6: informational",
        ),
        common.target(
            "drafts never right: speed vs without", figures["batch1_never_right"]["speedup"], ">=", 0.95, "x"
        ),
        common.target(
            "concurrency 16 throughput vs without",
            figures["concurrency16_greedy"]["speedup"],
            ">=",
            0.95,
            "x",
        ),
    ]
    return common.finish(
        "speculative", args, dict(workload=w, model=model.name), figures, targets, None, t_start
    )


if __name__ == "__main__":
    main()
