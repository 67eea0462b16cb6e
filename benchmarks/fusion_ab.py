"""The wide step's work around the GEMMs, fused and apart, alternated in one process (issue 44).

Three figures on a real model's weights (the GGUF through ``LLM``), each the two forms alternated
over ``--rounds`` rounds, the best of each reported and their ratio (apart / fused):

  down      one layer's down projection at ``--rows`` rows: SiLU-and-multiply into a kept buffer
            then the int8-activation GEMM, against the GEMM with SiLU inside its quantization
            (``llmserve_qi8_gemm_silu``)
  prefill   a 2,048-token prompt step's layer loop (the native call), the loop built with the
            fused down projections and with ``LLMSERVE_FUSED_GLU=0``
  head      the greedy head at ``--head-rows`` rows: the vocabulary slices with numpy's argmax,
            against the argmax inside the GEMM (``llmserve_qi8_gemm_argmax``)

Both forms give the same bits (tests/test_quant_int8act.py, tests/test_greedy_head.py); this checks
the outputs too. Quiet figures only at real-time priority (docs/performance.md).

    python -m benchmarks.fusion_ab --model qwen2.5-coder-0.5b --rounds 5
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np
import torch


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def down_ab(model, rows: list[int], rounds: int) -> dict:
    from kernels.cpu import quant_int8act

    layer = model.layers[len(model.layers) // 2]
    if type(layer.down_proj) is not quant_int8act.Int8ActLinear:
        return {"skipped": f"the down projection is {type(layer.down_proj).__name__}"}
    return {m: _down_one(model, layer, m, rounds) for m in rows}


def _down_one(model, layer, m: int, rounds: int) -> dict:
    from kernels.cpu import native_elementwise

    down = layer.down_proj
    k, n = down.in_features, down.out_features
    lib = native_elementwise.library()
    x = torch.randn(m, model.spec.hidden_size, generator=torch.Generator().manual_seed(m))
    gate_up = layer.gate_up_proj(x)
    act, y = torch.empty(m, k), torch.empty(m, n)
    threads = torch.get_num_threads()
    fused_fn = down._glu_fns[False]

    def apart():
        lib.llmserve_silu_and_mul_f32(gate_up.data_ptr(), m, k, act.data_ptr(), threads)
        down._gemm(down.code, act.data_ptr(), m, k, k, down._packed_ptr, n, down._bias_ptr,
                   y.data_ptr(), n, threads)  # fmt: skip

    def fused():
        fused_fn(down.code, gate_up.data_ptr(), m, k, 2 * k, down._packed_ptr, n, down._bias_ptr,
                 y.data_ptr(), n, threads)  # fmt: skip

    apart()
    want = y.clone()
    fused()
    assert torch.equal(y, want), "the fused down projection's bits differ"
    times = {"apart": [], "fused": []}
    for _ in range(rounds):
        times["apart"].append(_best(apart, 3))
        times["fused"].append(_best(fused, 3))
    a, f = min(times["apart"]), min(times["fused"])
    return {"apart_ms": 1e3 * a, "fused_ms": 1e3 * f, "ratio": a / f}


def head_ab(model, rows: list[int], rounds: int) -> dict:
    from kernels.cpu.greedy_head import ChunkedArgmax

    head = ChunkedArgmax.of(model.lm_head_proj)
    if head is None or head.fused is None:
        return {"skipped": "the head has no fused argmax"}
    return {m: _head_one(model, head, m, rounds) for m in rows}


def _head_one(model, head, m: int, rounds: int) -> dict:
    fused_fn = head.fused
    x = torch.randn(m, model.spec.hidden_size, generator=torch.Generator().manual_seed(m))
    results = {}

    def run(which):
        head.fused = fused_fn if which == "fused" else None
        results[which] = head(x)

    run("slices")
    run("fused")
    assert np.array_equal(results["slices"], results["fused"]), "the fused head's tokens differ"
    times = {"slices": [], "fused": []}
    for _ in range(rounds):
        for which in times:
            times[which].append(_best(lambda w=which: run(w), 3))
    head.fused = fused_fn
    s, f = min(times["slices"]), min(times["fused"])
    return {"slices_ms": 1e3 * s, "fused_ms": 1e3 * f, "ratio": s / f}


def prefill_ab(llm, rounds: int, tokens: int = 2048) -> dict:
    from engine_svc import SamplingParams

    engine = llm.engine
    model = engine.runner.forward.model
    rng = random.Random(7)
    vocab = min(engine.spec.vocab_size, 150000)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    spent: list[float] = []
    counter = [0]

    def one_step(fused: bool) -> float:
        os.environ["LLMSERVE_FUSED_GLU"] = "1" if fused else "0"
        model.invalidate()
        model.finalize()
        loop = model._native_loop
        f = loop.run

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent.append(time.perf_counter() - t)

        loop.run = timed
        for _ in range(tokens // 512):  # fresh prompts: nothing from the prefix cache
            counter[0] += 1
            engine.add_request(f"p{counter[0]}", [rng.randrange(3, vocab) for _ in range(512)], params)
        spent.clear()
        while engine.has_unfinished_requests():
            engine.step()
        loop.run = f
        return max(spent)  # the one 2,048-token step

    times = {"apart": [], "fused": []}
    for _ in range(rounds):
        times["apart"].append(one_step(False))
        times["fused"].append(one_step(True))
    os.environ.pop("LLMSERVE_FUSED_GLU", None)
    model.invalidate()
    a, f = min(times["apart"]), min(times["fused"])
    return {"apart_ms": 1e3 * a, "fused_ms": 1e3 * f, "ratio": a / f, "rounds": times}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--head-rows", type=int, nargs="+", default=[32, 64, 256])
    ap.add_argument(
        "--parts", nargs="+", default=["down", "prefill", "head"], choices=["down", "prefill", "head"]
    )
    args = ap.parse_args(argv)
    from benchmarks.real_peer import gguf_file
    from engine_svc import LLM

    llm = LLM(str(gguf_file(args.model)), device="cpu", seed=0)
    model = llm.engine.runner.forward.model
    out = {"threads": torch.get_num_threads()}
    if "down" in args.parts:
        out["down"] = down_ab(model, args.rows, args.rounds)
        print("down", out["down"], flush=True)
    if "head" in args.parts:
        out["head"] = head_ab(model, args.head_rows, args.rounds)
        print("head", out["head"], flush=True)
    if "prefill" in args.parts:
        out["prefill"] = prefill_ab(llm, args.rounds)
        print("prefill", {k: v for k, v in out["prefill"].items() if k != "rounds"}, flush=True)
    return out


if __name__ == "__main__":
    main()
