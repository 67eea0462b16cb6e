"""The wide step's work around the GEMMs, fused and apart, alternated in one process (issue 44).

Three figures on a real model's weights (the GGUF through ``LLM``), each the two forms alternated
over ``--rounds`` rounds, the best of each reported and their ratio (apart / fused):

  down      one layer's MLP at ``--rows`` rows: the gate/up GEMM, SiLU-and-multiply into a kept
            buffer, the down GEMM (apart); the gate/up GEMM then the down GEMM with SiLU inside its
            quantization (``llmserve_qi8_gemm_silu``); the whole MLP in one call, the gate/up
            outputs never stored (``llmserve_qi8_mlp``)
  prefill   a 2,048-token prompt step's layer loop (the native call), the loop built with the MLPs
            apart, with the fused down projections, and with the whole MLPs in one call
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
    from kernels.cpu import native_elementwise, quant_int8act

    gu, down = layer.gate_up_proj, layer.down_proj
    k, n = down.in_features, down.out_features
    lib = native_elementwise.library()
    h = model.spec.hidden_size
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(m))
    gate_up, act, y = torch.empty(m, 2 * k), torch.empty(m, k), torch.empty(m, n)
    threads = torch.get_num_threads()
    glu_fn = down._glu_fns[False]
    mlp_fn = quant_int8act.fused_mlp_fn(gu, down)

    def gate_up_gemm():
        gu._gemm(gu.code, x.data_ptr(), m, h, h, gu._packed_ptr, 2 * k, gu._bias_ptr, gate_up.data_ptr(),
                 2 * k, threads)  # fmt: skip

    def apart():
        gate_up_gemm()
        lib.llmserve_silu_and_mul_f32(gate_up.data_ptr(), m, k, act.data_ptr(), threads)
        down._gemm(down.code, act.data_ptr(), m, k, k, down._packed_ptr, n, down._bias_ptr,
                   y.data_ptr(), n, threads)  # fmt: skip

    def down_fused():
        gate_up_gemm()
        glu_fn(down.code, gate_up.data_ptr(), m, k, 2 * k, down._packed_ptr, n, down._bias_ptr,
               y.data_ptr(), n, threads)  # fmt: skip

    def mlp_fused():
        mlp_fn(1, gu.code, x.data_ptr(), m, h, h, gu._packed_ptr, gu._bias_ptr, k, down.code,
               down._packed_ptr, n, down._bias_ptr, y.data_ptr(), n, threads)  # fmt: skip

    forms = {"apart": apart, "down_fused": down_fused}
    if mlp_fn is not None:
        forms["mlp_fused"] = mlp_fused
    apart()
    want = y.clone()
    for name, f in forms.items():
        f()
        assert torch.equal(y, want), f"{name}: the bits differ"
    times = {name: [] for name in forms}
    for _ in range(rounds):
        for name, f in forms.items():
            times[name].append(_best(f, 3))
    a = min(times["apart"])
    out = {f"{name}_ms": 1e3 * min(t) for name, t in times.items()}
    out.update({f"ratio_{name}": a / min(t) for name, t in times.items() if name != "apart"})
    return out


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

    forms = {
        "apart": {"LLMSERVE_FUSED_GLU": "0", "LLMSERVE_FUSED_MLP": "0"},
        "down_fused": {"LLMSERVE_FUSED_GLU": "1", "LLMSERVE_FUSED_MLP": "0"},
        "mlp_fused": {
            "LLMSERVE_FUSED_GLU": "1",
            "LLMSERVE_FUSED_MLP": "1",
            "LLMSERVE_FUSED_MLP_MIN_ROWS": "1",
        },
    }
    saved = {k: os.environ.get(k) for f in forms.values() for k in f}

    def one_step(form: str) -> float:
        os.environ.update(forms[form])
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

    times = {form: [] for form in forms}
    for _ in range(rounds):
        for form in forms:
            times[form].append(one_step(form))
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    model.invalidate()
    a = min(times["apart"])
    out = {f"{form}_ms": 1e3 * min(t) for form, t in times.items()}
    out.update({f"ratio_{form}": a / min(t) for form, t in times.items() if form != "apart"})
    return out


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
        print("prefill", out["prefill"], flush=True)
    return out


if __name__ == "__main__":
    main()
