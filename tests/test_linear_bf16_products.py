"""bf16 products in the linears (``linear_dtype="bfloat16"``, ``--linear-dtype bfloat16``): a bf16
weight's GEMM with the activations rounded to bf16 and the products summed in VDPBF16PS's pairs
(``kernels/cpu/native/small_gemm.c``). The kernel against a numpy statement of that order on every
instruction set (the instruction itself and its order in fused multiply-adds), a row's bits alone,
in any batch, at any thread count and through a slice of the panels; the engine's greedy tokens
against HF's forward with every linear's input rounded to bf16 (an independent reader of the same
arithmetic), a request's tokens against its solo run in a mix, and the refusals."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc import SamplingParams
from engine_svc.config import EngineConfig
from kernels.cpu import linear as cpu_linear
from kernels.cpu import native_build, native_gemm
from tests.engine_helpers import (
    assert_greedy_matches,
    hf_greedy,
    make_engine,
    random_prompts,
    run_to_completion,
)

ISAS = native_build.supported_isas()
# (isa, native): the instruction where this CPU has it (the avx512 build), else its FMA order
PATHS = [(isa, False) for isa in ISAS] + [("avx512", True)] * ("avx512" in ISAS)


@pytest.fixture(params=PATHS, ids=lambda p: f"{p[0]}-{'native' if p[1] else 'fma'}")
def path(request):
    isa, native = request.param
    if native_gemm.library(isa) is None:
        pytest.fail(f"the native GEMM did not build for {isa} (a C compiler is on this machine)")
    if native and not native_gemm.bf16_dot_native(isa, True):
        pytest.skip("this CPU has no AVX512-BF16 (VDPBF16PS): its FMA order is tested instead")
    got = native_gemm.bf16_dot_native(isa, native)
    assert got == native
    yield isa
    native_gemm.bf16_dot_native(isa, True)


def products_linear(w, b, isa):
    return native_gemm.NativeLinear(w, b, isa=isa, weight_dtype=torch.bfloat16, products="bfloat16")


def bits(t) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# m = 300: two row chunks (MC = 256); 1,100: two blocks of rounded rows (DOT_ROWS = 1,024); k odd: a
# lone last k; n = 1 and 47: a narrow last panel
@pytest.mark.parametrize("m", [1, 5, 8, 9, 64, 300, 1100])
@pytest.mark.parametrize("k,n,bias", [(64, 47, True), (33, 200, False), (896, 96, True), (7, 1, True)])
def test_the_kernel_is_the_statement_bit_for_bit(path, m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g) * 4
    x[0, 0], x[-1, -1] = 3e-39, -1e-39  # denormals: read as zero, as the instruction does
    got = products_linear(w, b, path)(x)
    want = native_gemm.bf16_products_reference(x.numpy(), w, b)
    assert np.array_equal(bits(got), bits(want))
    # the order is the statement's, not fp32 on the rounded values: some output differs from that
    rounded = x.to(torch.bfloat16).float() @ w.float().T + (0 if b is None else b)
    if k >= 64 and m >= 8:
        assert not torch.equal(got, rounded)
    torch.testing.assert_close(got, rounded, rtol=1e-4, atol=1e-4)


def test_the_order_is_odd_then_even_a_pair():
    """One pair whose sum depends on the order: (1 + 2^-24) needs the odd product first. A kernel
    adding the even product first (or summing the pair before adding) gives another result."""
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.bfloat16)
    x = torch.tensor([[2.0**-24, 1.0, 2.0**-24, 0.0]])
    want = native_gemm.bf16_products_reference(x.numpy(), w)
    # odd first: 0 + 1 = 1, then + 2^-24 rounds to 1 (tie to even); then 1 + 0, then + 2^-24 -> 1
    assert want[0, 0] == 1.0
    for isa, native in PATHS:
        if native and not native_gemm.bf16_dot_native(isa, True):
            continue
        native_gemm.bf16_dot_native(isa, native)
        try:
            assert products_linear(w, None, isa)(x)[0, 0].item() == want[0, 0]
        finally:
            native_gemm.bf16_dot_native(isa, True)


def test_a_row_is_the_same_alone_in_any_batch_thread_count_and_panel_slice(path):
    g = torch.Generator().manual_seed(7)
    n, k = 150, 256
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    lin = products_linear(w, b, path)
    x = torch.randn(40, k, generator=g)
    full = lin(x)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in ([5], [0, 5], list(range(3, 12)), list(range(40))):
                got = lin(x[rows])
                assert torch.equal(got, full[rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)
    width = lin.panel  # one panel's columns through columns(): the greedy head's slices
    y = torch.empty(40 * width)
    lin.columns(x, lin.panel, width, y)
    assert torch.equal(y.view(40, width), full[:, lin.panel : lin.panel + width])


def test_bf16_products_take_a_bf16_weight_only():
    with pytest.raises(ValueError, match="bf16 products take a bf16 weight"):
        native_gemm.NativeLinear(torch.randn(8, 4), products="bfloat16")
    with pytest.raises(ValueError, match="products must be one of"):
        native_gemm.NativeLinear(torch.randn(8, 4), products="int8")
    cpu = torch.float32
    with pytest.raises(ValueError, match="this load's weights are float32 on the 'native' linears"):
        cpu_linear.linear_products_backend("bfloat16", "native", cpu, blocks=False)
    with pytest.raises(ValueError, match="quantized blocks"):
        cpu_linear.linear_products_backend("bfloat16", cpu_linear.NATIVE_BF16, torch.bfloat16, blocks=True)
    assert cpu_linear.linear_products_backend(None, "native", cpu, blocks=True) == "native"
    assert (
        cpu_linear.linear_products_backend("bfloat16", cpu_linear.NATIVE_BF16, torch.bfloat16, blocks=False)
        == cpu_linear.NATIVE_BF16_DOT
    )
    with pytest.raises(ValueError, match="linear_dtype must be one of"):
        EngineConfig(model="x", linear_dtype="fp8").validate()


def test_an_fp32_load_is_refused_with_the_reason(tiny_llama):
    with pytest.raises(ValueError, match="needs a bf16 checkpoint at dtype 'auto' or 'bfloat16'"):
        make_engine(tiny_llama, dtype="float32", linear_dtype="bfloat16")


def _round_linear_inputs(model) -> None:
    """HF's model with each nn.Linear's input rounded to bf16 (what the products read)."""

    def hook(_module, args):
        return (args[0].to(torch.bfloat16).float(),)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook)


def test_the_engine_equals_hf_with_bf16_linear_inputs_and_a_request_its_solo_run(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="engine_svc.model_setup"):
        engine = make_engine(tiny_llama, dtype="bfloat16", linear_dtype="bfloat16", max_num_batched_tokens=64)
    assert "bf16 products" in caplog.text
    model = engine.model
    assert model.linear_backend == cpu_linear.NATIVE_BF16_DOT
    assert model.layers[0].qkv_proj.products == "bfloat16" and model.lm_head_proj.products == "bfloat16"
    assert model.activation_dtype == torch.float32
    assert model._native_loop is not None, model.native_loop_reason  # the coded entry in the layer loop
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="bfloat16").float().eval()
    _round_linear_inputs(hf)
    prompts = random_prompts([1, 9, 41, 77, 130], 1024, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    mixed = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert_greedy_matches(hf, p, mixed[(str(i), 0)], hf_greedy(hf, p, 10))
        solo = run_to_completion(
            make_engine(tiny_llama, dtype="bfloat16", linear_dtype="bfloat16"), {"s": (p, params)}
        )
        assert solo[("s", 0)] == mixed[(str(i), 0)]
    # fp32 products on the same weights: other bits, so the option reaches the linears
    plain = make_engine(tiny_llama, dtype="bfloat16", max_num_batched_tokens=64)
    logits = [
        e.model.lm_head_proj(
            torch.randn(3, e.model.lm_head_proj.in_features, generator=torch.Generator().manual_seed(3))
        )
        for e in (engine, plain)
    ]
    assert not torch.equal(*logits)


def test_the_flag_reaches_the_engine_config_and_the_tiers_fingerprint(tiny_llama):
    from engine_svc.kv_tiers.fingerprint import kv_fingerprint
    from engine_svc.server.main import build_parser, engine_config_kwargs

    args = build_parser().parse_args(["--model", str(tiny_llama), "--linear-dtype", "bfloat16"])
    assert engine_config_kwargs(args)["linear_dtype"] == "bfloat16"
    prints = {
        d: kv_fingerprint(
            EngineConfig(model=str(tiny_llama), linear_dtype=d),
            [(2, 4, 16, 2, 64)],
            (None,),
            torch.float32,
            torch.device("cpu"),
            "torch",
            "avx2",
        )
        for d in (None, "float32", "bfloat16")
    }
    assert prints[None] == prints["float32"] != prints["bfloat16"]
