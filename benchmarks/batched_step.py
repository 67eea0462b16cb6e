"""Where a batched decode step goes on a real model, and steady-decode tokens/s by seats a step.

N requests of ``real_peer``'s workload (prompts cut to ``--prompt`` tokens) are prefilled, then the
engine decodes in steady state. Two figures, in one process:

  parts   per decode step: the layer loop's native call, the LM head (or the greedy rows'
          argmax from it; a head with no sliced path counts its logits inside that too), the
          sampler, the scheduler's schedule and update, the runner's inputs and sampling batch;
          their share of the step (at the served default seats a step, or ``--part-seats``)
  seats   tokens/s of steady decode with each of ``--seats`` seats a step (the scheduler's
          ``max_per_step``), alternated over ``--rounds`` rounds; the best round of each

    python -m benchmarks.batched_step --model qwen2.5-coder-0.5b --running 64 256 --seats 16 64 256
    python -m benchmarks.batched_step --model qwen2.5-coder-0.5b --weights bf16 --running 64

``--weights bf16`` runs ``real_peer``'s bf16 directory (``models/<model>-bf16``) at the engine's
default dtype instead of the GGUF.

Quiet figures only at real-time priority (docs/performance.md); read them as ratios in one run.
"""

from __future__ import annotations

import argparse
import collections
import time

from benchmarks.real_peer import bf16_dir, gguf_file, workload


def parts(engine, steps: int) -> dict[str, float]:
    """Seconds per decode step in each part, and the whole step (``step``)."""
    sched, runner = engine.scheduler, engine.runner
    model = runner.forward.model
    spent: dict[str, float] = collections.defaultdict(float)
    wrapped = []

    def wrap(obj, name: str, label: str) -> None:
        if obj is None or not hasattr(obj, name):
            return
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t

        setattr(obj, name, timed)
        wrapped.append((obj, name, f))

    for obj, name, label in (
        (sched, "schedule", "schedule"),
        (sched, "update_from_output", "update"),
        (runner, "update_states", "runner: follow the output"),
        (runner, "build_inputs", "runner: inputs"),
        (runner, "_sampling_batch", "runner: sampling batch"),
        (runner, "sampler", "sampler"),
        (model, "compute_logits", "LM head (logits)"),
        (model, "greedy_tokens", "LM head (greedy rows' argmax)"),
        (getattr(model, "_native_loop", None), "run", "layer loop (native)"),
        (engine, "step", "step"),
    ):
        wrap(obj, name, label)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        for obj, name, f in wrapped:
            setattr(obj, name, f)
    return {k: v / steps for k, v in spent.items()}


def steady(engine, seats: int, steps: int) -> float:
    sched = engine.scheduler
    sched.max_per_step = seats
    for _ in range(2):
        engine.step()
    tokens, t0 = 0, time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    return tokens / (time.perf_counter() - t0)


def run(
    model: str,
    running: int,
    prompt: int,
    seats: list[int],
    rounds: int,
    tokens: int,
    weights: str = "gguf",
    part_seats: int | None = None,
) -> dict:
    from engine_svc import LLM, SamplingParams

    path = gguf_file(model) if weights == "gguf" else bf16_dir(model)
    # The server's seats (``LLM`` alone seats every running sequence): the parts at the served step.
    llm = LLM(str(path), device="cpu", seed=0, max_seqs_per_step=None)
    engine = llm.engine
    sched = engine.scheduler
    default_seats = sched.max_per_step
    w = workload(running, min(engine.spec.vocab_size, 150000))
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - prompt, ignore_eos=True)
    for i, p in enumerate(w["prompts"]):
        engine.add_request(str(i), p[:prompt], params)
    sched.max_per_step = max(default_seats, running)  # the prompts in as few steps as the budget lets
    while sched.waiting or any(s.num_computed_tokens < s.request.num_prompt_tokens for s in sched.running):
        engine.step()
    sched.max_per_step = part_seats or default_seats
    per_step = parts(engine, max(8, 2 * running // sched.max_per_step))
    sched.max_per_step = default_seats
    rates: dict[int, list[float]] = {s: [] for s in seats}
    for _ in range(rounds):
        for s in seats:
            rates[s].append(steady(engine, s, max(4, tokens // s)))
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return dict(
        running=running,
        default_seats=default_seats,
        parts_s=per_step,
        seats_tok_s={s: max(v) for s, v in rates.items()},
    )


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a catalogue name with a GGUF in models/")
    ap.add_argument(
        "--weights", choices=("gguf", "bf16"), default="gguf", help="the GGUF or real_peer's bf16 dir"
    )
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt", type=int, default=128, help="each prompt cut to this many tokens")
    ap.add_argument("--seats", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="about this many tokens a seats measurement")
    ap.add_argument(
        "--part-seats", type=int, default=None,
        help="seats a step for the parts (default: the served default; 256: the offline LLM's wide step)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    out = []
    for n in args.running:
        r = run(
            args.model,
            n,
            args.prompt,
            [s for s in args.seats if s <= n],
            args.rounds,
            args.tokens,
            args.weights,
            args.part_seats,
        )
        step = r["parts_s"].get("step", 0.0)
        seats = f"{args.part_seats}" if args.part_seats else f"{r['default_seats']} (the served default)"
        print(f"{args.model} ({args.weights}), {n} running, {seats} seats a step: {1e3 * step:.1f} ms a step")
        for label, v in sorted(r["parts_s"].items(), key=lambda kv: -kv[1]):
            if label != "step":
                print(f"  {label:32s} {1e3 * v:8.2f} ms  {100 * v / step if step else 0:5.1f}%")
        print(
            "  steady decode tok/s by seats: "
            + ", ".join(f"{s}: {v:.0f}" for s, v in r["seats_tok_s"].items())
        )
        out.append(r)
    return out


if __name__ == "__main__":
    main()
