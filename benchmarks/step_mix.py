"""Where a real_peer run's wall time goes, by kind of step (issue 44): each ``LLMEngine.step`` of the
offline run timed, with the prompt and decode tokens its plan computed.

Kinds: prompt-only steps, steps with prompt chunks beside decodes, decode-only steps; per kind the
steps, seconds, share of the wall and tokens, and for the mixed steps the prompt tokens and rows a
step (10th / 50th / 90th percentile). Engine options as JSON, one run per set, in the order given
(alternate them for an A/B), the same workload as ``benchmarks.real_peer``:

    python -m benchmarks.step_mix --model qwen2.5-coder-0.5b --requests 64 \\
        --options '{"decode_stall_factor": 3}' '{}'

``--weights bf16 gguf`` runs each option set on real_peer's bf16 directory (``models/<model>-bf16``)
and on the GGUF, in that order; the table then also gives each kind's ms a token per weights.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.real_peer import bf16_dir, gguf_file, workload

KINDS = ("prompt", "mixed", "decode")
ROW_BANDS = ((1, 7), (8, 15), (16, 31), (32, 32), (33, 256))  # decode steps by rows


def run(model: str, num: int, options: dict, weights: str = "gguf") -> dict:
    from engine_svc import LLM, SamplingParams

    path = gguf_file(model) if weights == "gguf" else bf16_dir(model)
    llm = LLM(str(path), device="cpu", seed=0, **options)
    engine, sched = llm.engine, llm.engine.scheduler
    plan, step, steps, current = sched.schedule, engine.step, [], {}

    def schedule():
        out = plan()
        prompt = decode = 0
        for seq, n in zip(out.seqs, out.num_new, strict=True):
            num_tokens = len(seq.token_ids)
            if num_tokens - seq.num_computed_tokens == 1 and num_tokens != seq.request.num_prompt_tokens:
                decode += n
            else:
                prompt += n
        current.update(prompt=prompt, decode=decode)
        return out

    def timed_step():
        t = time.perf_counter()
        deltas = step()
        if current:
            steps.append(dict(current, seconds=time.perf_counter() - t))
            current.clear()
        return deltas

    sched.schedule, engine.step = schedule, timed_step
    greedy = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2
    llm.generate([[5 + i for i in range(40)], [7 + i for i in range(24)]], greedy, use_tqdm=False)
    steps.clear()
    w = workload(num, 150000)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w["output_lens"]]
    t = time.perf_counter()
    outs = llm.generate(w["prompts"], params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    kinds = {k: dict(steps=0, seconds=0.0, prompt=0, decode=0) for k in KINDS}
    for s in steps:
        k = kinds["prompt" if not s["decode"] else "decode" if not s["prompt"] else "mixed"]
        k["steps"] += 1
        k["seconds"] += s["seconds"]
        k["prompt"] += s["prompt"]
        k["decode"] += s["decode"]
    mixed = [s for s in steps if s["prompt"] and s["decode"]]
    pct = [10, 50, 90]
    return dict(
        options=options,
        weights=weights,
        wall_s=wall,
        output_tok_s=tokens / wall,
        steps=len(steps),
        kinds=kinds,
        mixed_prompt_pct=np.percentile([s["prompt"] for s in mixed], pct).tolist() if mixed else None,
        mixed_rows_pct=np.percentile([s["prompt"] + s["decode"] for s in mixed], pct).tolist()
        if mixed
        else None,
        decode_steps=[(s["decode"], s["seconds"]) for s in steps if not s["prompt"]],
    )


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--options", nargs="+", default=["{}"], help="engine options as JSON, one run each")
    ap.add_argument(
        "--weights", nargs="+", choices=("gguf", "bf16"), default=["gguf"],
        help="the GGUF and/or real_peer's bf16 dir, one run each per option set",
    )  # fmt: skip
    args = ap.parse_args(argv)
    results = []
    for text in args.options:
        for weights in args.weights:
            r = run(args.model, args.requests, json.loads(text), weights)
            results.append(r)
            report(r)
    return results


def report(r: dict) -> None:
    print(
        f"{r['options']} ({r['weights']}): {r['output_tok_s']:.1f} output tok/s, {r['wall_s']:.1f} s,"
        f" {r['steps']} steps"
    )
    for name, k in r["kinds"].items():
        share = k["seconds"] / r["wall_s"]
        tokens = k["prompt"] + k["decode"]
        per = 1e3 * k["seconds"] / tokens if tokens else 0.0
        print(
            f"  {name:6s} steps {k['steps']:5d}  {k['seconds']:6.1f} s ({share:.0%})"
            f"  prompt tokens {k['prompt']:6d}  decode tokens {k['decode']:6d}  {per:.2f} ms a token"
        )
    for lo, hi in ROW_BANDS:
        band = [s for s in r["decode_steps"] if lo <= s[0] <= hi]
        if band:
            sec, tok = sum(s[1] for s in band), sum(s[0] for s in band)
            print(
                f"  decode {lo:3d}-{hi:3d} rows: steps {len(band):4d}  {sec:6.1f} s"
                f"  {1e3 * sec / tok:.2f} ms a token"
            )
    if r["mixed_prompt_pct"]:
        print(f"  mixed steps' prompt tokens p10/50/90 {r['mixed_prompt_pct']}, rows {r['mixed_rows_pct']}")


if __name__ == "__main__":
    main()
