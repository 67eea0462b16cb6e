"""KV memory: how much of the allocated KV cache holds live tokens (target >= 0.95), and how many
requests run at once in a fixed KV budget against two contiguous allocators simulated on the same
workload: one reserving ``max_model_len`` per request (target >= 4x) and one reserving
prompt + max_tokens (target >= 2x).

Memory use depends on the scheduler and the block pool, not on the numbers the model computes,
so the model is a stub of fixed cost here: the real scheduler, KV cache manager, input
preparation and sampler run every step. Requests declare ``max_tokens`` (what a client asks for)
but end earlier, where their EOS would fall: the driver aborts them there, as the gateway does on a
stop string, so no allocator can know the true length in advance.
"""

from __future__ import annotations

from collections import deque

from benchmarks import common

FULL = dict(
    num_requests=256,
    prompt_range=(32, 512),
    output_range=(16, 256),
    declared_max_tokens=512,
    max_model_len=2048,
    num_kv_blocks=1024,
    block_size=16,
)
QUICK = dict(
    num_requests=32,
    prompt_range=(8, 64),
    output_range=(4, 32),
    declared_max_tokens=64,
    max_model_len=256,
    num_kv_blocks=64,
    block_size=16,
)


def simulate_contiguous(reqs: list[common.Req], budget_tokens: int, reserve) -> dict:
    """FCFS admission while the request's whole reservation fits; a request's prompt takes one step,
    then one token per step until its true length. Mean concurrency is taken over the steps where
    someone still waits (the phase in which memory decides how many run)."""
    waiting = deque(reqs)
    running: list[list] = []  # [req, tokens produced so far]
    free = budget_tokens
    saturated, live_sum, reserved_sum = [], 0, 0
    while waiting or running:
        while waiting and reserve(waiting[0]) <= free:
            r = waiting.popleft()
            free -= reserve(r)
            running.append([r, 0])
        for item in running:
            item[1] += 1
        live_sum += sum(len(r.prompt) + n - 1 for r, n in running)
        reserved_sum += budget_tokens - free
        if waiting:
            saturated.append(len(running))
        for item in [x for x in running if x[1] >= x[0].output_len]:
            running.remove(item)
            free += reserve(item[0])
    return dict(
        mean_running_saturated=sum(saturated) / max(1, len(saturated)),
        utilization=live_sum / max(1, reserved_sum),
    )


def main() -> dict:
    args, t_start, w, model = common.begin(__doc__, FULL, QUICK)
    engine = common.make_engine(
        model,
        num_kv_blocks=w["num_kv_blocks"],
        block_size=w["block_size"],
        max_model_len=w["max_model_len"],
        enable_prefix_caching=False,
    )
    common.install_stub_model(engine)
    rng_reqs = common.random_requests(
        w["num_requests"], w["prompt_range"], w["output_range"], engine.spec.vocab_size, seed=7
    )
    reqs = [common.Req(r.rid, r.prompt, w["declared_max_tokens"], stop_after=r.max_tokens) for r in rng_reqs]
    bs = w["block_size"]
    budget_tokens = w["num_kv_blocks"] * bs
    acc = dict(live=0, allocated=0)
    series: dict[str, list] = dict(kv_usage=[], live_over_allocated=[])
    saturated: list[int] = []

    def on_step(eng, trace):
        live = sum(s.num_computed_tokens for s in eng.scheduler.running)
        allocated = eng.kv.pool.num_used * bs
        acc["live"] += live
        acc["allocated"] += allocated
        step = trace.steps[-1]
        if step.waiting:
            saturated.append(step.running)
        series["kv_usage"].append([step.t, step.kv_used / step.kv_total])
        series["live_over_allocated"].append([step.t, live / allocated if allocated else 1.0])

    trace = common.drive(engine, reqs, on_step=on_step)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0, "blocks leaked after every request finished"
    paged = dict(
        utilization=acc["live"] / acc["allocated"],
        mean_running_saturated=sum(saturated) / max(1, len(saturated)),
        peak_running=max(s.running for s in trace.steps),
        preemptions=stats.num_preemptions,
        steps=len(trace.steps),
        output_tokens=trace.output_tokens,
    )
    max_len = simulate_contiguous(reqs, budget_tokens, lambda r: w["max_model_len"])
    declared = simulate_contiguous(reqs, budget_tokens, lambda r: len(r.prompt) + r.max_tokens)
    figures = dict(
        paged=paged,
        contiguous_max_model_len=max_len,
        contiguous_prompt_plus_max_tokens=declared,
        concurrency_vs_max_model_len=paged["mean_running_saturated"] / max_len["mean_running_saturated"],
        concurrency_vs_prompt_plus_max_tokens=(
            paged["mean_running_saturated"] / declared["mean_running_saturated"]
        ),
    )
    print(
        f"paged: {paged['utilization']:.3f} of allocated KV slots hold live tokens; "
        f"{paged['mean_running_saturated']:.1f} requests run at once ({paged['preemptions']} preemptions)"
    )
    print(
        f"contiguous, max_model_len each: {max_len['mean_running_saturated']:.1f} at once, "
        f"utilization {max_len['utilization']:.3f}"
    )
    print(
        f"contiguous, prompt + max_tokens each: {declared['mean_running_saturated']:.1f} at once, "
        f"utilization {declared['utilization']:.3f}"
    )
    targets = [
        common.target("live tokens / allocated KV slots", paged["utilization"], ">=", 0.95),
        common.target(
            "requests at once vs contiguous max_model_len",
            figures["concurrency_vs_max_model_len"],
            ">=",
            4.0,
            "x",
        ),
        common.target(
            "requests at once vs contiguous prompt+max_tokens",
            figures["concurrency_vs_prompt_plus_max_tokens"],
            ">=",
            2.0,
            "x",
        ),
    ]
    config = dict(workload=w, kv_budget_tokens=budget_tokens, seed=7, model="stub (fixed cost)")
    return common.finish("kv_memory", args, config, figures, targets, common.thin(series), t_start)


if __name__ == "__main__":
    main()
