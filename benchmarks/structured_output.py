"""Structured output: what constraining costs, measured in one run.

- Throughput of 64 requests with half of them JSON-schema constrained vs none constrained (same
  prompts, same output budget; target >= 0.9x).
- Token-mask time per step with 64 constrained sequences: p50 and p99 of the fill (llguidance fills
  the rows in parallel when the step is planned; the sampler then applies the bitmask).
- Compile time of a 20-field schema (off the loop), and a second request with the same schema
  paying none (a cached, warmed matcher is copied).

The model is the benchmark shape with the project's trained tokenizer (a real BPE vocabulary, so the
masks are computed over real tokens).
"""

from __future__ import annotations

import json
import random
import shutil
import time

from benchmarks import common
from engine_svc import SamplingParams, StructuredOutputsParams
from engine_svc import output_builder as builder_module

FULL = dict(requests=64, prompt_len=(32, 128), max_tokens=64, vocab=8192, repeats=2)
QUICK = dict(requests=8, prompt_len=(8, 24), max_tokens=12, vocab=1024, repeats=1)


def schema(fields: int = 20) -> dict:
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"},
        {"enum": ["a", "b", "c"]},
        {"type": "string", "maxLength": 12},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def model_with_tokenizer(quick: bool, vocab: int):
    """The benchmark model, with a trained BPE tokenizer of its vocabulary beside it."""
    from tokenizer_svc.train import save_tokenizer, train_tokenizer

    base = common.model_dir(quick)
    out = common.CACHE_DIR / f"{base.name}-tok{vocab}"
    if not (out / ".complete").exists():
        from engine_svc.models.build import build_random_model

        shape = json.loads((base / ".complete").read_text()) | {"vocab_size": vocab}
        tmp = common.CACHE_DIR / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build_random_model(tmp, "llama", seed=common.MODEL_SEED, eos_token_id=1, **shape)
        save_tokenizer(
            train_tokenizer(vocab_size=vocab), tmp, model_max_length=shape["max_position_embeddings"]
        )
        (tmp / ".complete").write_text("ok")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


class MaskTimer:
    """Times each step's mask fill (the work; the sampler's apply is a few tensor ops), which the
    scheduler's output builder does when it plans the step."""

    def __init__(self):
        self.times: list[float] = []
        self.rows: list[int] = []
        self._inner = builder_module.fill_grammar_bitmask

    def __call__(self, matchers, executor, vocab_size, drafts=None):
        t0 = time.perf_counter()
        out = self._inner(matchers, executor, vocab_size, drafts)
        self.times.append(time.perf_counter() - t0)
        self.rows.append(sum(m is not None for m in matchers))
        return out


def run(engine, prompts, params_of) -> float:
    """Output tokens per second for the requests, all added at once, with a cold prefix cache (the
    runs share prompts: a warm cache would hand the later run its prefill for free)."""
    engine.kv.pool.reset_prefix_cache()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", p, params_of(i))
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    return tokens / (time.perf_counter() - t0)


def main() -> dict:
    args, t_start, w, _ = common.begin(__doc__, FULL, QUICK)
    model = model_with_tokenizer(args.quick, w["vocab"])
    engine = common.make_engine(model, num_kv_blocks=2048)
    common.warm_up(engine)
    rng = random.Random(0)
    prompts = [
        common.random_prompt(rng, rng.randint(*w["prompt_len"]), w["vocab"]) for _ in range(w["requests"])
    ]
    spec = StructuredOutputsParams(json=schema())

    # Compile time, then the cache: a second request with the same schema compiles nothing.
    t0 = time.perf_counter()
    first = engine.grammars.submit(spec.to_grammar())
    first.result()
    compile_s = time.perf_counter() - t0
    compiled_before = engine.grammars.num_compiled
    engine.grammars.submit(spec.to_grammar()).result()
    second_compiles = engine.grammars.num_compiled - compiled_before

    def plain(i):
        return SamplingParams(temperature=1.0, seed=i, max_tokens=w["max_tokens"], ignore_eos=True)

    def half(i):
        p = plain(i)
        if i % 2 == 0:
            p.structured_outputs = spec
        return p

    def all_constrained(i):
        p = plain(i)
        p.structured_outputs = spec
        return p

    ratios, plain_tps, half_tps = [], [], []
    for r in range(w["repeats"]):  # alternated: plain, half, half, plain, ...
        if r % 2:
            b = run(engine, prompts, half)
            a = run(engine, prompts, plain)
        else:
            a = run(engine, prompts, plain)
            b = run(engine, prompts, half)
        plain_tps.append(a)
        half_tps.append(b)
        ratios.append(b / a)
    timer = MaskTimer()
    builder_module.fill_grammar_bitmask = timer
    try:
        run(engine, prompts, all_constrained)
    finally:
        builder_module.fill_grammar_bitmask = timer._inner
    full_steps = [t for t, r in zip(timer.times, timer.rows, strict=True) if r == w["requests"]]
    mask = common.latency_summary([1e3 * t for t in full_steps])
    ratio = min(ratios)
    print(f"throughput, half constrained / none: {ratios} (plain {plain_tps}, half {half_tps} tok/s)")
    print(f"mask per step at {w['requests']} constrained: p50 {mask['p50']:.2f} ms, p99 {mask['p99']:.2f} ms")
    print(
        f"compile of a 20-field schema: {1e3 * compile_s:.1f} ms; a second request compiled {second_compiles}"
    )
    figures = dict(
        throughput_ratio_half_constrained=ratio,
        ratios=ratios,
        plain_tok_s=plain_tps,
        half_constrained_tok_s=half_tps,
        mask_ms_at_full_batch=mask,
        mask_steps_measured=len(full_steps),
        compile_ms_20_fields=1e3 * compile_s,
        second_request_compiles=second_compiles,
        library="llguidance",
    )
    targets = [
        common.target(
            "throughput, half of the requests JSON-schema constrained vs none", ratio, ">=", 0.9, "x"
        ),
        common.target("compiles for a second request with the same schema", second_compiles, "<=", 0, ""),
    ]
    config = dict(workload=w, model=model.name)
    return common.finish("structured_output", args, config, figures, targets, None, t_start)


if __name__ == "__main__":
    main()
