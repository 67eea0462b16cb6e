"""The quantized GEMM (``kernels/cpu/native/quant_gemm.c`` through ``kernels/cpu/quant_gemm.py``) on
every instruction set this CPU runs. Blocks are made and read back by the ``gguf`` package (llama.cpp's
own quantizer and dequantizer: an independent reader): the kernel against its dequantized weight in a
float64 matmul, bit-equal to the fp32 native GEMM on that weight, a row bit-equal alone, in any batch
and at any thread count, only its own outputs written."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.cpu import native_build, native_gemm, quant_gemm
from tests.gguf_files import random_k_blocks

ISAS = native_build.supported_isas()
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
# 256-weight super-blocks: rows a multiple of 256
K_FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
MIXED = ("Q5_0+Q8_0",)  # a fused projection whose rows are Q5_0 then Q8_0 (MixedRows)


@pytest.fixture(params=ISAS)
def isa(request):
    if quant_gemm.library(request.param) is None:
        pytest.fail(f"quant_gemm did not build for {request.param} (a C compiler is on this machine)")
    return request.param


def gguf_weight(fmt: str, n: int, k: int, seed: int):
    """(blocks in our form, the gguf package's fp32 dequantization of the same blocks). The gguf
    package has no K-quant quantizer: those blocks are random with sane fp16 scales."""
    if "+" in fmt and n == 1:  # one row: the first format's alone
        return gguf_weight(fmt.split("+")[0], n, k, seed)
    if "+" in fmt:  # the last third of the rows in the second format
        first, second = fmt.split("+")
        tail = max(1, n // 3)
        a, ra = gguf_weight(first, n - tail, k, seed)
        b, rb = gguf_weight(second, tail, k, seed + 1)
        return quant_gemm.concat_rows([a, b]), torch.cat([ra, rb])
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).numpy()
    qtype = getattr(GGMLQuantizationType, fmt)
    random = fmt in K_FORMATS or fmt == "IQ4_NL"  # no quantizer in the gguf package
    raw = random_k_blocks(n, k, fmt, seed) if random else quants.quantize(w, qtype)
    ref = torch.from_numpy(np.asarray(quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k).copy())
    return quant_gemm.from_gguf_blocks(fmt, raw, (n, k)), ref


@pytest.mark.parametrize("fmt", FORMATS + MIXED)
@pytest.mark.parametrize("m", [1, 5, 8, 9, 64, 257])
@pytest.mark.parametrize("k,n,bias", [(576, 200, False), (64, 47, True), (1536, 49, False), (32, 1, True)])
def test_quant_gemm_equals_the_gguf_dequantized_matmul(isa, fmt, m, k, n, bias):
    check_against_gguf(isa, fmt, m, k, n, bias)


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("m", [1, 5, 8, 9, 64, 257])
@pytest.mark.parametrize("k,n,bias", [(512, 200, False), (256, 47, True), (1536, 49, False), (256, 1, True)])
def test_k_quant_gemm_equals_the_gguf_dequantized_matmul(isa, fmt, m, k, n, bias):
    check_against_gguf(isa, fmt, m, k, n, bias)


def check_against_gguf(isa, fmt, m, k, n, bias):
    qw, ref = gguf_weight(fmt, n, k, seed=m * 1000 + k + n)
    assert torch.equal(qw.dequantize(), ref)  # our reading of the blocks is the gguf package's
    g = torch.Generator().manual_seed(m)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    got = quant_gemm.QuantLinear(qw, b, isa=isa)(x)
    want = x.double() @ ref.double().T + (0 if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=2e-5, atol=2e-5 * max(1.0, float(ref.abs().max())))
    # The same arithmetic as the fp32 native GEMM on the dequantized weight, bit for bit.
    assert torch.equal(got, native_gemm.NativeLinear(ref, b, isa=isa)(x))


@pytest.mark.parametrize("fmt", FORMATS + K_FORMATS + MIXED)
def test_a_row_is_bit_equal_alone_batched_and_at_any_thread_count(isa, fmt):
    k = 512 if fmt in K_FORMATS else 576
    qw, _ = gguf_weight(fmt, 300, k, seed=7)
    lin = quant_gemm.QuantLinear(qw, isa=isa)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(lin(x))
            alone = torch.cat([lin(x[i : i + 1]) for i in range(0, 70, 9)])
            assert torch.equal(alone, runs[-1][0:70:9])
            assert torch.equal(lin(x[3:20]), runs[-1][3:20])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, runs[0]) for r in runs)


@pytest.mark.parametrize("fmt", FORMATS + K_FORMATS)
def test_only_its_own_outputs_are_written(isa, fmt):
    n, k, m = 37, 256 if fmt in K_FORMATS else 64, 5
    qw, ref = gguf_weight(fmt, n, k, seed=3)
    lin = quant_gemm.QuantLinear(qw, isa=isa)
    x = torch.randn(m, k)
    # Rows ldy apart inside a larger buffer filled with a sentinel: the kernel writes n of each row.
    buf = torch.full((m, n + 11), 12345.0)
    lib = quant_gemm.library(isa)
    rc = lib.llmserve_qgemm(
        quant_gemm.FORMATS[fmt], x.data_ptr(), m, k, k, lin.packed.data_ptr(), n, None,
        buf.data_ptr(), n + 11, 2,
    )  # fmt: skip
    assert rc == 0
    assert torch.all(buf[:, n:] == 12345.0)
    want = (x.double() @ ref.double().T).float()
    torch.testing.assert_close(buf[:, :n], want, rtol=2e-5, atol=2e-5 * max(1.0, float(ref.abs().max())))


def test_bad_input_is_refused(isa):
    qw, _ = gguf_weight("Q8_0", 8, 64, seed=1)
    lin = quant_gemm.QuantLinear(qw, isa=isa)
    with pytest.raises(ValueError, match="rows of 64"):
        lin(torch.randn(2, 32))
    assert lin(torch.randn(0, 64)).shape == (0, 8)
    lib = quant_gemm.library(isa)
    y = torch.full((1, 8), 7.0)
    x = torch.randn(1, 64)
    assert (
        lib.llmserve_qgemm(9, x.data_ptr(), 1, 64, 64, lin.packed.data_ptr(), 8, None, y.data_ptr(), 8, 1)
        == -1
    )
    assert torch.all(y == 7.0)  # an unknown format writes nothing
    # U8_16 (Q2_K's form) takes whole blocks of 16
    rc = lib.llmserve_qgemm(5, x.data_ptr(), 1, 24, 64, lin.packed.data_ptr(), 8, None, y.data_ptr(), 8, 1)
    assert rc == -1
    assert torch.all(y == 7.0)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_gemm.quantize_rows(torch.randn(4, 40), "Q8_0")
    with pytest.raises(ValueError, match="no quantized kernel"):
        quant_gemm.from_gguf_blocks("IQ2_XXS", np.zeros((1, 66), np.uint8), (1, 256))
    with pytest.raises(ValueError, match="not whole IQ4_XS blocks"):
        quant_gemm.from_gguf_blocks("IQ4_XS", np.zeros((1, 136), np.uint8), (1, 288))
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        quant_gemm.from_gguf_blocks("Q4_K", np.zeros((1, 288), np.uint8), (1, 576))


@pytest.mark.parametrize("fmt,gguf_type", [("Q8_0", "Q8_0"), ("Q4_1", "Q4_1")])
def test_load_time_quantization_matches_the_gguf_quantizer(fmt, gguf_type):
    """``quantize_rows`` (an HF checkpoint quantized at load) makes the blocks the gguf package's
    quantizer makes from the same weights, up to ties in rounding: dequantized within a step."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g) * 0.05
    ours = quant_gemm.quantize_rows(w, fmt).dequantize()
    qtype = getattr(GGMLQuantizationType, gguf_type)
    theirs = torch.from_numpy(
        np.asarray(quants.dequantize(quants.quantize(w.numpy(), qtype), qtype), np.float32)
    )
    step = (w.reshape(64, 8, 32).abs().amax(-1) / (127 if fmt == "Q8_0" else 7)).repeat_interleave(32, 1)
    assert torch.all((ours - theirs.reshape(64, 256)).abs() <= step + 1e-6)
    assert (ours - w).abs().mean() < (0.004 if fmt == "Q8_0" else 0.02) * w.abs().mean() * 25


@pytest.mark.parametrize("name", ["quant_gemm", "quant_int8act"])
def test_every_instruction_set_build_compiles(name):
    """The AVX-512 build (and the others) compiles on any x86-64 machine with the compiler, whether
    or not this CPU runs it: the paths a CI machine without AVX-512 cannot run are at least built
    (they run where the CPU has them: the tests above take every ISA ``supported_isas`` lists)."""
    if native_build.compiler() is None:
        pytest.fail("no C compiler on this machine")
    isas = ["avx512", "avx2", "generic"] if platform.machine() in ("x86_64", "AMD64") else ["generic"]
    for isa in isas:
        assert native_build.build(name, isa).exists()
