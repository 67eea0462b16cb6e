"""The CPU paths of ``kernels/cpu`` against the plain ones, in one process: A and B interleaved,
repeated, each figure a ratio measured in the same run (the machines are shared and noisy).

    python -m scripts.cpu_speed                       # every section, 1 torch thread
    python -m scripts.cpu_speed --sections gemm step  # some of them
    python -m scripts.cpu_speed --threads 2 --out cpu_speed.json

- ``gemm``: GFLOP/s of the engine's projections (qkv, o, gate_up, down, LM head of the benchmark
  model: hidden 512, intermediate 1408, vocab 32000) through ``F.linear`` and through oneDNN with
  prepacked weights, at M = 1, 16, 64, 512 tokens.
- ``step``: one forward (layers, no LM head) at decode batch 1, 16 and 64 (512-token contexts,
  scattered blocks) and a 512-token prefill: old = ``F.linear`` + the reference twins, new = the
  engine's defaults (oneDNN linears + ``kernels/cpu`` attention).
- ``generate``: ``LLM.generate`` output tokens/s on 64 requests (prompts 32-512, outputs 16-256,
  greedy, ``ignore_eos``), old vs new, alternating, fresh prompts each round.
- ``bf16``: the step shapes in fp32 vs bf16 (both on the new path), where the CPU has bf16
  instructions.
- ``threads``: the new path at every usable core vs one core left (the server's placement): step
  times, then generate throughput (``--generate-rounds 0`` skips the generate runs).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

OLD = dict(linear_backend="dense", kernel_backend="reference")
NEW = dict(linear_backend=None, kernel_backend=None)


def best_rate(fns: dict, work: float, seconds: float, rounds: int) -> dict[str, float]:
    """work / best time per call for each fn, the fns interleaved in every round."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            n, t0 = 0, time.perf_counter()
            while True:
                fn()
                n += 1
                dt = time.perf_counter() - t0
                if dt > seconds:
                    break
            best[name] = min(best[name], dt / n)
    return {name: work / t for name, t in best.items()}


def gemm_section(rounds: int) -> dict:
    from kernels.cpu.linear import OneDNNLinear

    shapes = {
        "qkv": (512, 768),
        "o": (512, 512),
        "gate_up": (512, 2816),
        "down": (1408, 512),
        "lm_head": (512, 32000),
    }
    out = {}
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k) * k**-0.5
        packed = OneDNNLinear(w)
        for m in (1, 16, 64, 512):
            x = torch.randn(m, k)
            rates = best_rate(
                {"f_linear": functools.partial(F.linear, x, w), "onednn": functools.partial(packed, x)},
                2 * m * k * n / 1e9,
                0.05,
                rounds,
            )
            row = {key: round(v, 1) for key, v in rates.items()}
            row["ratio"] = round(rates["onednn"] / rates["f_linear"], 3)
            out[f"{name} K{k} N{n} M{m}"] = row
            print(
                f"gemm {name:8s} K={k:5d} N={n:5d} M={m:4d}: F.linear {row['f_linear']:6.1f}  "
                f"oneDNN {row['onednn']:6.1f} GFLOP/s  ratio {row['ratio']:.2f}",
                flush=True,
            )
    return out


def _step_inputs(spec, batch: int, ctx: int, q_len: int, block_size: int = 16, dtype=torch.float32):
    from engine_svc.model_setup import allocate_kv_caches
    from engine_svc.models.decoder import AttentionInputs
    from engine_svc.parallel.shard import Shard

    g = torch.Generator().manual_seed(batch * 7 + ctx)
    per = (ctx + block_size - 1) // block_size
    num_blocks = batch * per + 8
    tables = torch.randperm(num_blocks, generator=g)[: batch * per].view(batch, per).int()
    caches = allocate_kv_caches(spec, Shard(), num_blocks, block_size, dtype, torch.device("cpu"))
    for c in caches:
        c.normal_(generator=g)
    pos = torch.cat([torch.arange(ctx - q_len, ctx) for _ in range(batch)])
    rows = torch.arange(batch).repeat_interleave(q_len)
    slots = tables.long()[rows, pos // block_size] * block_size + pos % block_size
    attn = AttentionInputs(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32) * q_len,
        max_query_len=q_len,
        max_seq_len=ctx,
    )
    ids = torch.randint(2, spec.vocab_size, (batch * q_len,), generator=g)
    return ids, pos, caches, attn


STEP_SHAPES = {
    "decode b1 ctx512": (1, 512, 1),
    "decode b16 ctx512": (16, 512, 1),
    "decode b64 ctx512": (64, 512, 1),
    "prefill 512": (1, 512, 512),
}


def step_section(model_path: str, rounds: int, systems: dict | None = None) -> dict:
    """Per-step time of each system (name -> (options, dtype)); the ratio is first / second."""
    from engine_svc.config import EngineConfig
    from engine_svc.model_setup import load_model
    from engine_svc.models.spec import ModelSpec
    from engine_svc.parallel.shard import Shard
    from kernels.backend import select_kernels

    systems = systems or {"old": (OLD, torch.float32), "new": (NEW, torch.float32)}
    spec = ModelSpec.from_path(model_path)
    models = {}
    for name, (opts, dtype) in systems.items():
        cfg = EngineConfig(model=model_path, linear_backend=opts["linear_backend"])
        model, _ = load_model(cfg, spec, dtype, torch.device("cpu"), 4096, Shard())
        models[name] = (model, select_kernels("cpu", opts["kernel_backend"]), dtype)
    a_name, b_name = list(systems)
    out = {}
    for label, (batch, ctx, q_len) in STEP_SHAPES.items():
        fns = {}
        for name, (m, k, dtype) in models.items():
            ids, pos, caches, attn = _step_inputs(spec, batch, ctx, q_len, dtype=dtype)
            fns[name] = functools.partial(m, k, ids, pos, caches, attn)
        with torch.inference_mode():
            a, b = fns[a_name]().float(), fns[b_name]().float()
        diff = float((a - b).abs().max() / a.abs().max())
        rates = best_rate(fns, 1.0, 0.3, rounds)  # steps per second
        row = {f"{n}_ms": round(1e3 / r, 3) for n, r in rates.items()}
        row[f"{a_name}/{b_name}"] = ratio = round(rates[b_name] / rates[a_name], 3)
        row["max_rel_diff"] = diff
        out[label] = row
        print(
            f"step {label:18s}: {a_name} {row[a_name + '_ms']:8.2f} ms  "
            f"{b_name} {row[b_name + '_ms']:8.2f} ms  {a_name}/{b_name} {ratio:.2f}  (rel diff {diff:.1e})",
            flush=True,
        )
    return out


def _with_threads(n: int, fn):
    torch.set_num_threads(n)
    return fn()


def threads_step_section(model_path: str, rounds: int, threads: dict[str, int]) -> dict:
    """The new path's per-step time at each thread count (the same model), interleaved."""
    from engine_svc.config import EngineConfig
    from engine_svc.model_setup import load_model
    from engine_svc.models.spec import ModelSpec
    from engine_svc.parallel.shard import Shard
    from kernels.backend import select_kernels

    spec = ModelSpec.from_path(model_path)
    model, _ = load_model(
        EngineConfig(model=model_path), spec, torch.float32, torch.device("cpu"), 4096, Shard()
    )
    kernels = select_kernels("cpu")
    (a_name, a), (b_name, b) = threads.items()
    out = {}
    for label, shape in STEP_SHAPES.items():
        step = functools.partial(model, kernels, *_step_inputs(spec, *shape))
        fns = {name: functools.partial(_with_threads, n, step) for name, n in threads.items()}
        rates = best_rate(fns, 1.0, 0.3, rounds)
        row = {f"{n}_ms": round(1e3 / r, 3) for n, r in rates.items()}
        row[f"{a_name}/{b_name}"] = ratio = round(rates[b_name] / rates[a_name], 3)
        out[label] = row
        print(
            f"threads {label:18s}: {a_name} ({a}) {row[a_name + '_ms']:8.2f} ms  "
            f"{b_name} ({b}) {row[b_name + '_ms']:8.2f} ms  speedup {ratio:.2f}",
            flush=True,
        )
    return out


def _requests(seed: int, vocab: int, n: int = 64):
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(2, vocab) for _ in range(rng.randint(32, 512))])
        outs.append(rng.randint(16, 256))
    return prompts, outs


def _generate_rate(llm, seed: int, vocab: int) -> float:
    from engine_svc import SamplingParams

    prompts, outs = _requests(seed, vocab)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert sum(len(r.outputs[0].token_ids) for r in results) == sum(outs)
    return sum(outs) / wall


def generate_section(model_path: str, rounds: int, systems: dict, threads: dict | None = None) -> dict:
    """Output tok/s of each system, alternating A/B/A/B with the same fresh prompts per round."""
    from engine_svc import LLM

    llms = {name: LLM(model=model_path, **opts) for name, opts in systems.items()}
    vocab = llms[next(iter(llms))].engine.spec.vocab_size
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for name in order:
            if threads:
                torch.set_num_threads(threads[name])
            rates[name].append(_generate_rate(llms[name], 1000 + r, vocab))
        print(
            f"generate round {r}: " + "  ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in rates.items()),
            flush=True,
        )
    names = list(llms)
    ratios = [b / a for a, b in zip(rates[names[0]], rates[names[1]], strict=True)]
    return {
        **{f"{n}_tok_s": [round(v, 1) for v in vals] for n, vals in rates.items()},
        f"{names[1]}/{names[0]}": [round(x, 3) for x in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["gemm", "step", "generate"],
        choices=["gemm", "step", "bf16", "generate", "threads"],
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds for gemm/step")
    parser.add_argument("--generate-rounds", type=int, default=4)
    parser.add_argument(
        "--quick", action="store_true", help="the small benchmark model, one round: a smoke run"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from benchmarks.common import model_dir

    torch.set_num_threads(args.threads)
    model_path = str(model_dir(args.quick))
    rounds, gen_rounds = (1, 2) if args.quick else (args.rounds, args.generate_rounds)
    result = {
        "threads": args.threads,
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }
    if "gemm" in args.sections:
        result["gemm"] = gemm_section(rounds)
    if "step" in args.sections:
        result["step"] = step_section(model_path, rounds)
    if "bf16" in args.sections:
        from kernels.cpu.features import native_bf16

        if native_bf16():
            systems = {"fp32": (NEW, torch.float32), "bf16": (NEW, torch.bfloat16)}
            result["bf16_step"] = step_section(model_path, rounds, systems)
        else:
            result["bf16_step"] = "skipped: no AVX-512 BF16 / AMX on this CPU"
    if "generate" in args.sections and gen_rounds:
        result["generate"] = generate_section(model_path, gen_rounds, {"old": OLD, "new": NEW})
    if "threads" in args.sections:
        cores = len(os.sched_getaffinity(0))
        threads = {"one_left": max(1, cores - 1), "all_cores": cores}
        result["threads_step"] = threads_step_section(model_path, rounds, threads)
        if gen_rounds:
            systems = {"one_left": NEW, "all_cores": NEW}
            result["threads_generate"] = generate_section(model_path, gen_rounds, systems, threads=threads)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
