"""A running stream's inter-token latency while a long prompt is prefilled, against its latency
alone: the step's work budget (engine_svc/step_cost.py) against a budget of tokens alone, each
with and without the bound beside decodes (``--decode-stall-factor``, 3 on CPU).

One engine; each round runs both budgets, alternating (the machine may be shared): a stream decodes
alone for a while (its ITL alone: the steps it gets a token in), then a long prompt of fresh random
tokens arrives, and the stream's ITL is taken over the steps until that prompt's first token. The
figures are ratios measured in the same round, so a busy machine moves both sides alike.

    python -m benchmarks.long_prompt_itl --model models/default --prompt 7000 --rounds 2
    python -m benchmarks.long_prompt_itl --model models/qwen2.5-coder-0.5b --prompt 18000 --rounds 1 \
        --budgets stall
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine_svc import EngineConfig, SamplingParams
from engine_svc.engine import LLMEngine
from engine_svc.step_cost import FloorFit, StepCost


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def one_run(
    engine: LLMEngine,
    ratio: float,
    prompt_len: int,
    alone_steps: int,
    rng: random.Random,
    stall: float = 0.0,
    fit: FloorFit | None = None,
) -> dict:
    cfg = engine.config
    engine.scheduler.cost = StepCost(cfg.max_num_batched_tokens, ratio)
    engine.scheduler.stall_factor = stall
    engine.scheduler.floor_fit = fit
    vocab = engine.spec.vocab_size
    tag = f"{ratio:g}-{rng.random():.6f}"
    stream = SamplingParams(
        temperature=0.0, max_tokens=engine.max_model_len - prompt_len - 64, ignore_eos=True
    )
    engine.add_request(f"s-{tag}", [rng.randrange(3, vocab) for _ in range(32)], stream)
    itl_alone: list[float] = []
    first = True  # the stream's first token comes from its own prompt's step: not a decode
    while len(itl_alone) < alone_steps:
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        if any(d.request_id == f"s-{tag}" and d.new_token_ids for d in deltas):
            if not first:
                itl_alone.append(dt)
            first = False
    engine.add_request(
        f"long-{tag}",
        [rng.randrange(3, vocab) for _ in range(prompt_len)],
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    )
    itl_long: list[float] = []
    steps, t_start = 0, time.perf_counter()
    done = False
    while not done:
        t0 = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t0
        steps += 1
        if any(d.request_id == f"s-{tag}" and d.new_token_ids for d in deltas):
            itl_long.append(dt)
        done = any(d.request_id == f"long-{tag}" for d in deltas)
    ttft = time.perf_counter() - t_start
    engine.abort_request(f"s-{tag}")
    while engine.has_unfinished_requests():
        engine.step()
    alone_p99 = _p(itl_alone, 0.99)
    floor = fit.floor(engine.scheduler.step_floor) if fit is not None else engine.scheduler.step_floor
    return dict(
        step_floor=floor,
        ratio=ratio,
        decode_stall_factor=stall,
        itl_alone_p50_ms=1000 * _p(itl_alone, 0.5),
        itl_alone_p99_ms=1000 * alone_p99,
        itl_long_p50_ms=1000 * _p(itl_long, 0.5),
        itl_long_p99_ms=1000 * _p(itl_long, 0.99),
        itl_long_max_ms=1000 * max(itl_long),
        p99_over_alone=_p(itl_long, 0.99) / alone_p99,
        p99_over_alone_p50=_p(itl_long, 0.99) / _p(itl_alone, 0.5),
        prefill_steps=steps,
        long_ttft_s=ttft,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--prompt", type=int, default=7000, help="long prompt tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--alone-steps", type=int, default=40)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument(
        "--budgets",
        default="tokens,work,stall",
        help="which of tokens / work / stall (work + the stall bound with the floor measured: the "
        "defaults) / static (the stall bound with the fixed floor) to run",
    )
    args = ap.parse_args(argv)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        )
    )
    model_ratio = engine.scheduler.cost.ratio
    stall = engine.scheduler.stall_factor or 3.0
    fit = engine.scheduler.floor_fit or FloorFit()
    rng = random.Random(0)
    one_run(engine, model_ratio, 256, 5, rng)  # warm-up
    rows = []
    wanted = set(args.budgets.split(","))
    variants = [
        (name, ratio, factor, floor_fit)
        for key, name, ratio, factor, floor_fit in (
            ("tokens", "tokens", 0.0, 0.0, None),
            ("work", "work", model_ratio, 0.0, None),
            ("stall", f"work, stall x{stall:g}", model_ratio, stall, fit),
            ("static", f"work, stall x{stall:g}, fixed floor", model_ratio, stall, None),
        )
        if key in wanted
    ]
    for r in range(args.rounds):
        for name, ratio, factor, floor_fit in variants if r % 2 == 0 else variants[::-1]:
            row = one_run(engine, ratio, args.prompt, args.alone_steps, rng, factor, floor_fit)
            row["round"] = r
            row["budget"] = name
            rows.append(row)
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    print(f"model {args.model}: attention_work_ratio {model_ratio:.3g}, prompt {args.prompt} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
