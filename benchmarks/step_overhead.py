"""Scheduler and step overhead: time per step spent outside the model, with the model replaced by a
stub of fixed cost. Judged on a mixed scenario at 256 running (target: < 0.5 ms): requests finish
at their own lengths (outputs 16-256) and new ones arrive to take their places (prompts 32-512,
about two joins and two leaves per step), sampling with temperature 0.8 and top-p 0.95. The
steady all-decode figure at 1, 64 and 256 running (greedy, nobody joins or leaves: the engine's
``only_decodes`` fast path) is kept as the labelled best case, with its per-request growth 64 ->
256 (at most linear).

What counts as overhead: scheduling, block bookkeeping, prefix-hash registration, input
preparation (token ids, positions, slot mapping, block tables), sampling bookkeeping and output
handling. The stub's own time (it returns preallocated hidden states and logits) is measured
inside it and subtracted. The sampler's vectorized math over the vocabulary (argmax of
[rows, vocab] logits; a kernel on a GPU) is timed separately and reported next to it.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from benchmarks import common

FULL = dict(
    batch_sizes=[1, 64, 256],
    timed_steps=60,
    profiled_steps=30,
    prompt_len=32,
    stub_cost_s=0.001,
    mixed_running=256,
    mixed_prompt_range=(32, 512),
    mixed_output_range=(16, 256),
    mixed_warmup_steps=50,
    mixed_steps=60,
)
QUICK = dict(
    batch_sizes=[1, 8, 32],
    timed_steps=5,
    profiled_steps=3,
    prompt_len=8,
    stub_cost_s=0.0005,
    mixed_running=32,
    mixed_prompt_range=(8, 64),
    mixed_output_range=(4, 32),
    mixed_warmup_steps=10,
    mixed_steps=10,
)
LINEAR_SLACK = 1.2  # noise margin on "per-request overhead does not grow with the batch"


class TimedSampler:
    def __init__(self, sampler):
        self.sampler = sampler
        self.inside_s = 0.0

    def __call__(self, logits, batch):
        t0 = time.perf_counter()
        out = self.sampler(logits, batch)
        self.inside_s += time.perf_counter() - t0
        return out


def decode_engine(model, n: int, w: dict):
    """An engine with ``n`` requests all past their prompt, decoding; the model is the stub."""
    engine = common.make_engine(
        model, max_num_seqs=max(256, n), max_seqs_per_step=max(256, n), num_kv_blocks=n * 64 + 64
    )
    stub = common.install_stub_model(engine, w["stub_cost_s"])
    sampler = TimedSampler(engine.runner.sampler)
    engine.runner.sampler = sampler
    reqs = common.random_requests(
        n, (w["prompt_len"], w["prompt_len"]), (1, 1), engine.spec.vocab_size, seed=n
    )
    for r in reqs:
        engine.add_request(r.rid, r.prompt, common.greedy(900))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # settle into steady decode
        engine.step()
    return engine, stub, sampler


def measure(engine, stub, sampler, steps: int) -> dict:
    stub.inside_s = sampler.inside_s = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        deltas = engine.step()
    wall = time.perf_counter() - t0
    assert len(deltas) == len(engine.scheduler.running), "every running request must decode each step"
    overhead = wall - stub.inside_s - sampler.inside_s
    return dict(
        step_ms=1e3 * wall / steps,
        stub_ms=1e3 * stub.inside_s / steps,
        sampler_math_ms=1e3 * sampler.inside_s / steps,
        overhead_ms=1e3 * overhead / steps,
    )


class ClonedLogitsStub(common.StubModel):
    """The stub for sampling with temperature: the sampler may scale its logits in place, so each step
    gets a copy (timed inside the stub, so subtracted like the rest of its time)."""

    def compute_logits(self, hidden):
        t0 = time.perf_counter()
        out = self.logits[: hidden.shape[0]].clone()
        self.inside_s += time.perf_counter() - t0
        return out


def mixed_run(model, n: int, w: dict, steps: int) -> dict:
    """``n`` running, each to its own length, replaced as it finishes; temperature + top-p sampling."""
    import random

    from engine_svc import SamplingParams

    engine = common.make_engine(model, max_num_seqs=n, max_seqs_per_step=n, num_kv_blocks=n * 40 + 256)
    c = engine.config
    stub = ClonedLogitsStub(
        engine.spec, c.max_num_batched_tokens, max(c.max_num_seqs, c.max_num_batched_tokens), w["stub_cost_s"]
    )
    engine.runner.forward.model = stub
    sampler = TimedSampler(engine.runner.sampler)
    engine.runner.sampler = sampler
    rng = random.Random(n)
    vocab = engine.spec.vocab_size
    counter = iter(range(10**9))

    def add_one():
        plen = rng.randint(*w["mixed_prompt_range"])
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=rng.randint(*w["mixed_output_range"]))
        engine.add_request(f"m{next(counter)}", common.random_prompt(rng, plen, vocab), params)

    def top_up():
        s = engine.stats()
        for _ in range(n - s.num_running - s.num_waiting):
            add_one()

    top_up()
    for _ in range(w["mixed_warmup_steps"]):  # past the first wave of prefills, into a steady churn
        engine.step()
        top_up()
    stub.inside_s = sampler.inside_s = 0.0
    joins = leaves = 0
    wall = 0.0
    running = []
    for _ in range(steps):
        t0 = time.perf_counter()
        before = engine.stats().num_running + engine.stats().num_waiting
        top_up()
        joins += n - before
        deltas = engine.step()
        wall += time.perf_counter() - t0
        leaves += sum(1 for d in deltas if d.finished)
        running.append(engine.stats().num_running)
    overhead = wall - stub.inside_s - sampler.inside_s
    return dict(
        step_ms=1e3 * wall / steps,
        stub_ms=1e3 * stub.inside_s / steps,
        sampler_math_ms=1e3 * sampler.inside_s / steps,
        overhead_ms=1e3 * overhead / steps,
        joins_per_step=joins / steps,
        leaves_per_step=leaves / steps,
        mean_running=sum(running) / len(running),
    )


def profile(engine, steps: int, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    return text[text.find("ncalls") :] if "ncalls" in text else text


def main() -> dict:
    args, t_start, w, model = common.begin(__doc__, FULL, QUICK)
    per_batch: dict[str, dict] = {}
    profile_text = ""
    for n in w["batch_sizes"]:
        engine, stub, sampler = decode_engine(model, n, w)
        per_batch[str(n)] = m = measure(engine, stub, sampler, w["timed_steps"])
        m["overhead_us_per_request"] = 1e3 * m["overhead_ms"] / n
        print(
            f"{n:4d} running: step {m['step_ms']:.2f} ms = stub {m['stub_ms']:.2f} + sampler math "
            f"{m['sampler_math_ms']:.2f} + overhead {m['overhead_ms']:.3f} ms "
            f"({m['overhead_us_per_request']:.1f} us per request)"
        )
        if n == w["batch_sizes"][-1]:
            profile_text = profile(engine, w["profiled_steps"])
        del engine
    nm = w["mixed_running"]
    mixed = mixed_run(model, nm, w, w["mixed_steps"])
    print(
        f"mixed at {nm}: step {mixed['step_ms']:.2f} ms = stub {mixed['stub_ms']:.2f} + sampler math "
        f"{mixed['sampler_math_ms']:.2f} + overhead {mixed['overhead_ms']:.3f} ms; "
        f"{mixed['joins_per_step']:.2f} joins, {mixed['leaves_per_step']:.2f} leaves per step, "
        f"{mixed['mean_running']:.0f} running on average"
    )
    big, mid = (per_batch[str(n)] for n in (w["batch_sizes"][-1], w["batch_sizes"][1]))
    growth = big["overhead_us_per_request"] / mid["overhead_us_per_request"]
    figures = dict(
        mixed=mixed,
        per_batch=per_batch,
        per_request_growth_largest_vs_middle=growth,
        profile_largest_batch=profile_text,
    )
    print(f"profile at {w['batch_sizes'][-1]} running (cProfile, by own time):\n{profile_text}")
    largest = w["batch_sizes"][-1]
    targets = [
        common.target(
            f"overhead per step, mixed at {nm} running (joins, leaves, temperature + top-p)",
            mixed["overhead_ms"],
            "<=",
            0.5,
            " ms",
        ),
        common.target(
            f"overhead per step at {largest} running, all decode (best case)",
            big["overhead_ms"],
            "<=",
            0.5,
            " ms",
            note="steady decode, nobody joins or leaves: the fast path",
        ),
        common.target(
            f"overhead per request, {largest} vs {w['batch_sizes'][1]} running (<= 1: linear or better)",
            growth,
            "<=",
            LINEAR_SLACK,
            "x",
        ),
        common.target(
            f"overhead + sampler math per step at {largest} running",
            big["overhead_ms"] + big["sampler_math_ms"],
            "<=",
            0.5,
            " ms",
            note="informational: includes the argmax over [rows, vocab]",
        ),
    ]
    config = dict(workload=w, model=model.name)
    series = dict(overhead_ms=[[int(n), per_batch[n]["overhead_ms"]] for n in per_batch])
    return common.finish("step_overhead", args, config, figures, targets, series, t_start)


if __name__ == "__main__":
    main()
