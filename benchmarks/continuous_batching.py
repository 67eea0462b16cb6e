"""Continuous batching: output tokens/s of the engine against HF static batching on the same weights
(target >= 3x), against the engine itself run in static-batch mode (target >= 1.5x), and against
vLLM's CPU build when a separate venv has it (target: ahead)."""

from __future__ import annotations

from benchmarks import common
from benchmarks.hf_static import load_hf_model, run_static_batches
from benchmarks.vllm_peer import find_vllm_python, run_vllm

FULL = dict(num_requests=64, prompt_range=(32, 512), output_range=(16, 256), static_batch=16)
QUICK = dict(num_requests=8, prompt_range=(8, 64), output_range=(4, 24), static_batch=4)


def run_engine_static(engine, reqs: list[common.Req], batch_size: int) -> dict:
    """Admit a batch, run it to its end, then the next one: the engine without continuous batching."""
    wall = 0.0
    tokens = 0
    for b in range(0, len(reqs), batch_size):
        trace = common.drive(engine, reqs[b : b + batch_size])
        wall += trace.wall_s
        tokens += trace.output_tokens
    return dict(wall_s=wall, output_tokens=tokens, output_tok_s=tokens / wall)


def main() -> dict:
    args, t_start, w, model = common.begin(__doc__, FULL, QUICK)
    vocab = common.vocab_size(args.quick)
    reqs = common.random_requests(w["num_requests"], w["prompt_range"], w["output_range"], vocab, seed=1234)
    expected_tokens = sum(r.max_tokens for r in reqs)

    engine = common.make_engine(model)
    common.warm_up(engine)
    continuous = common.drive(engine, reqs)
    assert continuous.output_tokens == expected_tokens, "the engine did not produce every requested token"
    cont = dict(
        wall_s=continuous.wall_s,
        output_tokens=continuous.output_tokens,
        output_tok_s=continuous.output_tok_s(),
        steps=len(continuous.steps),
        peak_running=max(s.running for s in continuous.steps),
    )
    print(f"engine continuous: {cont['output_tok_s']:.1f} output tok/s ({cont['wall_s']:.1f} s)")

    static = run_engine_static(
        engine, [common.Req(r.rid + "s", r.prompt, r.max_tokens) for r in reqs], w["static_batch"]
    )
    print(f"engine static batches of {w['static_batch']}: {static['output_tok_s']:.1f} output tok/s")
    del engine

    hf = run_static_batches(load_hf_model(model), reqs, w["static_batch"])
    print(
        f"HF static batches of {w['static_batch']}: {hf['output_tok_s']:.1f} output tok/s "
        f"(computed {hf['computed_tokens']} tokens for {hf['output_tokens']} useful)"
    )

    figures = dict(
        engine_continuous=cont,
        engine_static=static,
        hf_static=hf,
        ratio_vs_hf=cont["output_tok_s"] / hf["output_tok_s"],
        ratio_vs_engine_static=cont["output_tok_s"] / static["output_tok_s"],
    )
    targets = [
        common.target(
            "continuous vs HF static batching (output tok/s)", figures["ratio_vs_hf"], ">=", 3.0, "x"
        ),
        common.target(
            "continuous vs engine static-batch mode (output tok/s)",
            figures["ratio_vs_engine_static"],
            ">=",
            1.5,
            "x",
        ),
    ]
    python, why = find_vllm_python()
    figures["vllm_note"] = why
    if python is None:
        print(f"vLLM CPU comparison skipped: {why}")
    else:
        vllm = run_vllm(
            python, model, [r.prompt for r in reqs], [r.max_tokens for r in reqs], common.CACHE_DIR / "vllm"
        )
        figures["vllm_cpu"] = vllm
        figures["ratio_vs_vllm"] = cont["output_tok_s"] / vllm["output_tok_s"]
        print(f"vLLM CPU: {vllm['output_tok_s']:.1f} output tok/s ({why})")
        targets.append(
            common.target("continuous vs vLLM CPU (output tok/s)", figures["ratio_vs_vllm"], ">=", 1.0, "x")
        )
    series = dict(
        kv_usage=[[s.t, s.kv_used / s.kv_total] for s in continuous.steps],
        running=[[s.t, s.running] for s in continuous.steps],
        ttft_s=[continuous.ttft(r.rid) for r in reqs],
        itl_s=common.latency_summary(continuous.itls(r.rid for r in reqs)),
    )
    config = dict(workload=w, model=model.name, seed=1234, kv_blocks_total=continuous.steps[0].kv_total)
    print(
        f"  continuous / HF = {figures['ratio_vs_hf']:.2f}x, continuous / engine static = "
        f"{figures['ratio_vs_engine_static']:.2f}x"
    )
    return common.finish("continuous_batching", args, config, figures, targets, common.thin(series), t_start)


if __name__ == "__main__":
    main()
