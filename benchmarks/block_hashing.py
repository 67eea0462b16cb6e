"""The cost of deterministic prefix-cache block hashes (BLAKE2b, ``engine_svc/block_hash.py``) and of
KV-cache events, per engine step.

Three figures: the time per 16-token block of the new hash against Python's ``hash()`` of a tuple
(the randomized one it replaced); the share of a step's time spent hashing, on the engine with a
stub model of zero cost (everything measured is engine overhead, so this is the worst case: a real
forward only adds time); and the step time with a KV-event subscriber against none, alternated and
repeated (noisy on a shared machine: the time spent publishing, measured directly, is the
judged figure).
"""

from __future__ import annotations

import random
import time
import timeit

from benchmarks import common
from engine_svc import kv_cache_manager
from engine_svc.block_hash import chain_hash
from engine_svc.server.kv_event_feed import KvEventFeed

FULL = dict(requests=256, prompt_range=(64, 1024), output_range=(8, 64), repeats=3, timeit_n=200_000)
QUICK = dict(requests=24, prompt_range=(16, 96), output_range=(2, 8), repeats=1, timeit_n=5_000)


def per_block_us(n: int) -> tuple[float, float]:
    ids = [random.Random(0).randrange(150_000) for _ in range(16)]
    new = timeit.timeit(lambda: chain_hash(0x1234_5678_9ABC_DEF0, ids), number=n) / n * 1e6
    old = timeit.timeit(lambda: hash((0x1234_5678_9ABC_DEF0, tuple(ids))), number=n) / n * 1e6
    return new, old


def workload(cfg: dict, vocab: int) -> list[common.Req]:
    """Requests that share system prompts (prefix hits) with distinct tails."""
    rng = random.Random(1)
    systems = [common.random_prompt(rng, 256, vocab) for _ in range(4)]
    reqs = common.random_requests(cfg["requests"], cfg["prompt_range"], cfg["output_range"], vocab)
    for i, r in enumerate(reqs):
        r.prompt = systems[i % 4][: len(r.prompt) // 2] + r.prompt[len(r.prompt) // 2 :]
    return reqs


def run(model, cfg: dict, events: bool) -> dict:
    engine = common.make_engine(model, num_kv_blocks=2048)
    common.install_stub_model(engine)
    hashed = {"s": 0.0, "blocks": 0}
    real = kv_cache_manager.chain_hash

    def timed(parent, ids):
        t0 = time.perf_counter()
        out = real(parent, ids)
        hashed["s"] += time.perf_counter() - t0
        hashed["blocks"] += 1
        return out

    feed, sub, batches, publish_s = KvEventFeed(), None, 0, 0.0

    def on_step(engine, trace):  # the loop's publish is part of a step's cost; the reader is not
        nonlocal batches, publish_s
        t0 = time.perf_counter()
        feed.publish(engine)
        publish_s += time.perf_counter() - t0
        while sub is not None and sub.next(timeout=0) is not None:
            batches += 1

    if events:
        sub = feed.subscribe(engine, max_batches=1 << 16)
    kv_cache_manager.chain_hash = timed
    try:
        trace = common.drive(engine, workload(cfg, engine.spec.vocab_size), on_step=on_step)
    finally:
        kv_cache_manager.chain_hash = real
    steps = [s.dt for s in trace.steps]
    return dict(
        step_ms=1000 * (sum(steps) + publish_s) / len(steps),
        hash_ms_per_step=1000 * hashed["s"] / len(steps),
        blocks_per_step=hashed["blocks"] / len(steps),
        publish_ms_per_step=1000 * publish_s / len(steps),
        batches=batches,
    )


def main() -> None:
    args, t_start, cfg, model = common.begin(__doc__, FULL, QUICK)
    new_us, old_us = per_block_us(cfg["timeit_n"])
    off, on = [], []
    for _ in range(cfg["repeats"]):  # alternated
        off.append(run(model, cfg, events=False))
        on.append(run(model, cfg, events=True))
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    figures = dict(
        blake2b_us_per_block=new_us,
        python_hash_us_per_block=old_us,
        hash_ms_per_step=mean(off, "hash_ms_per_step"),
        blocks_hashed_per_step=mean(off, "blocks_per_step"),
        step_ms_events_off=mean(off, "step_ms"),
        step_ms_events_on=mean(on, "step_ms"),
        hash_share_of_step=mean(off, "hash_ms_per_step") / mean(off, "step_ms"),
        events_on_over_off=mean(on, "step_ms") / mean(off, "step_ms"),
        event_batches=mean(on, "batches"),
        publish_ms_per_step=mean(on, "publish_ms_per_step"),
        publish_share_of_step=mean(on, "publish_ms_per_step") / mean(on, "step_ms"),
    )
    for k, v in figures.items():
        print(f"  {k}: {v:.4g}")
    targets = [
        common.target("hash share of a stub-model step", figures["hash_share_of_step"], "<=", 0.05),
        common.target(
            "event publishing share of a stub-model step", figures["publish_share_of_step"], "<=", 0.05
        ),
    ]
    common.finish("block_hashing", args, cfg, figures, targets, None, t_start)


if __name__ == "__main__":
    main()
