"""bf16 and fp16 weights on the native GEMM (``kernels/cpu/native/small_gemm.c``; ``dtype="bfloat16"``
/ ``"float16"`` on a CPU, and ``auto`` on a bf16 or fp16 checkpoint): the kernel bit-equal to the fp32
GEMM on the widened weights and close to a float64 matmul of them, a row's result the same alone and
in any batch at any thread count, and the engine's greedy tokens equal to HF's fp32 forward on the
widened weights (the path runs fp32 activations: docs/quantization.md, "bf16 and fp16 weights"), with
no fp32 copy of a weight kept."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc import SamplingParams
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
HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(params=ISAS)
def isa(request):
    if native_gemm.library(request.param) is None:
        pytest.fail(f"the native GEMM did not build for {request.param} (a C compiler is on this machine)")
    return request.param


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 7, 8, 9, 64, 300])
# K = 2,816: a panel over small_gemm.c's NEXT_PANEL_MAX as fp32 on AVX-512 (48 columns), so its
# many rows stay widened in registers; below it, 24 rows or more read a panel widened once.
@pytest.mark.parametrize(
    "k,n,bias", [(512, 768, False), (64, 47, True), (33, 200, True), (8, 1, True), (2816, 70, True)]
)
def test_half_weights_equal_the_fp32_gemm_on_their_values(isa, dtype, m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g) * k**-0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    lin = native_gemm.NativeLinear(w.to(dtype), b, isa=isa)
    assert lin.packed.dtype == dtype
    got = lin(x)
    assert got.dtype == torch.float32
    rounded = w.to(dtype).float()
    if lin.amx:  # bf16 on AMX-BF16 tiles (where granted): their own statement (tests/test_bf16_amx.py)
        wbits = w.to(dtype).view(torch.int16).numpy().view("uint16")
        want = native_gemm.amx_bf16_reference(x.numpy(), wbits, None if b is None else b.numpy())
        assert torch.equal(got, torch.from_numpy(want))
    else:
        assert torch.equal(got, native_gemm.NativeLinear(rounded, b, isa=isa)(x))
    want = x.double() @ rounded.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(got, want.float(), rtol=2e-5, atol=2e-5)
    # weight_dtype rounds an fp32 weight the same way
    assert torch.equal(native_gemm.NativeLinear(w, b, isa=isa, weight_dtype=dtype)(x), got)


def test_fp16_weights_widen_exactly_at_the_edges_of_the_format(isa):
    """Every class of fp16 value (subnormals, signed zeros, the largest normals, the smallest
    normal) widens to the fp32 value torch reads: a one-hot input row reads one weight back."""
    edges = [2**-24, -(2**-24), 1023 * 2**-24, 2**-14, -0.0, 0.0, 65504.0, -65504.0, 1.0, -2.5, 3e-5, 6e-8]
    k = len(edges)
    w = torch.tensor(edges, dtype=torch.float16).repeat(20, 1)
    lin = native_gemm.NativeLinear(w, isa=isa)
    got = lin(torch.eye(k))  # row i reads column i of every output: w[:, i]
    assert torch.equal(got.T, w.float())  # (a sum from +0 makes -0 read as +0: equal here)


@pytest.mark.parametrize("dtype", HALF)
def test_half_weights_give_a_row_the_same_bits_in_any_batch_and_thread_count(isa, dtype):
    """A row alone (widened in registers), in a few rows, and among 24 or more (the panel widened
    once into a buffer): the same bits."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 576, generator=g).to(dtype)
    lin = native_gemm.NativeLinear(w, torch.randn(200, generator=g), isa=isa)
    x = torch.randn(70, 576, generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 9, 23, 24, 70):
                assert torch.equal(lin(x[:rows]), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", HALF)
def test_half_resolves_to_the_native_gemm_with_fp32_activations(dtype):
    cpu = torch.device("cpu")
    backend = cpu_linear.NATIVE_HALF[dtype]
    want = backend if native_build.chosen_isa() in native_gemm.FASTER_THAN_ONEDNN else None
    got = cpu_linear.resolve_linear_backend("auto", cpu, dtype)
    if want:
        assert got == want
    assert cpu_linear.resolve_linear_backend("native", cpu, dtype) == backend
    lin = cpu_linear.make_linear(backend, torch.randn(8, 4))
    assert isinstance(lin, native_gemm.NativeLinear) and lin.packed.dtype == dtype
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        cpu_linear.resolve_linear_backend("native", cpu, torch.float64)


def test_bf16_engine_greedy_equals_hf_fp32_on_the_rounded_weights(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="engine_svc.model_setup"):
        engine = make_engine(tiny_llama, dtype="bfloat16", linear_backend="native", block_size=16)
    assert "bf16 weights, fp32 activations on the native GEMM" in caplog.text
    assert engine.model.linear_backend == cpu_linear.NATIVE_BF16
    layer = engine.model.layers[0]
    assert layer.qkv_proj.packed.dtype == torch.bfloat16
    assert engine.runner.forward.kv_caches[0].dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="bfloat16").float().eval()
    prompts = random_prompts([1, 9, 41, 77], 1024, seed=23)
    refs = [hf_greedy(hf, p, 8) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert_greedy_matches(hf, p, outputs[(str(i), 0)], ref)


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def half_checkpoint(request, tiny_llama, tmp_path_factory):
    """The tiny Llama saved as a bf16 or fp16 checkpoint (as most published checkpoints are)."""
    import shutil

    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=request.param).save_pretrained(out)
    for f in tiny_llama.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out, getattr(torch, request.param)


def test_auto_serves_a_half_checkpoint_as_stored_and_equals_hf_fp32_on_it(half_checkpoint):
    """``dtype`` unset on a bf16/fp16 checkpoint: its weights stay 16-bit (packed linears, the
    embedding table looked up and widened; no fp32 copy of either), everything between the ops is
    fp32, and the greedy tokens are HF's fp32 forward on the same weights widened."""
    path, dtype = half_checkpoint
    engine = make_engine(path)
    model = engine.model
    assert engine.dtype == dtype and model.activation_dtype == torch.float32
    assert model.linear_backend == cpu_linear.NATIVE_HALF[dtype]
    assert model.layers[0].qkv_proj.packed.dtype == dtype and model.lm_head_proj.packed.dtype == dtype
    assert model.embed.dtype == dtype  # the lookup widens the rows it reads
    kept = {n: p.dtype for n, p in model.named_parameters() if p.numel() and n != "embed"}
    assert kept and set(kept.values()) == {torch.float32}, kept  # the norms, widened
    assert engine.runner.forward.kv_caches[0].dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).float().eval()
    prompts = random_prompts([1, 9, 41, 77], 1024, seed=29)
    refs = [hf_greedy(hf, p, 8) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert_greedy_matches(hf, p, outputs[(str(i), 0)], ref)
    # the same weights asked for in fp32 give the same tokens (the widening is exact)
    as_fp32 = make_engine(path, dtype="float32")
    assert as_fp32.model.linear_backend == "native" and as_fp32.model.embed.dtype == torch.float32
    again = run_to_completion(as_fp32, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert again == outputs


def test_auto_keeps_an_fp32_checkpoint_in_fp32(tiny_llama):
    engine = make_engine(tiny_llama)
    assert engine.dtype == torch.float32 and engine.model.linear_backend in ("native", "onednn", "dense")


def test_lora_on_the_bf16_path_equals_peft_on_the_rounded_base(tiny_llama, tmp_path):
    """The adapters' slots hold what flows between the ops (fp32 here), added to the bf16-weight
    projections' outputs: PEFT's fp32 model on the bf16-rounded base weights is the reference."""
    from peft import PeftModel

    from engine_svc import LLM, LoRARequest
    from tests.lora_helpers import make_adapter

    adapter = make_adapter(tiny_llama, tmp_path / "qv4", 4, ["q_proj", "v_proj"], seed=3)
    prompts = random_prompts([6, 19], 1024, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_llama), dtype="bfloat16", enable_lora=True, max_lora_rank=8, num_kv_blocks=64) as llm:
        assert llm.engine.model.linear_backend == cpu_linear.NATIVE_BF16
        got = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="bfloat16").float()
    hf = PeftModel.from_pretrained(base, adapter).eval()
    for p, out in zip(prompts, got, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 6)
