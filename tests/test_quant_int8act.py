"""The int8-activation quantized GEMM (``kernels/cpu/native/quant_int8act.c`` through
``kernels/cpu/quant_int8act.py``) on every instruction set this CPU runs, AVX-512 and AVX2 each
with and without VNNI, and AVX-512 with AMX tiles where the OS grants them. Weights are the gguf
package's blocks (llama.cpp's quantizer); the expected result is
``quant_int8act.reference``, the documented math in numpy (activations quantized in fp32, integer
block sums in int64, the float steps in the documented order), bit for bit, and a float64 matmul of
the same quantized activations and dequantized weights within fp32 rounding. A row is bit-equal
alone, in any batch, at any thread count and on every ISA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels.cpu import native_build, native_elementwise, quant_gemm, quant_int8act
from tests.gguf_files import random_k_blocks

# "A+B": a fused projection whose rows are A then B (quant_gemm.MixedRows, run as row segments)
FORMATS = (
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
    "Q5_0+Q8_0", "Q5_0+Q6_K", "Q2_K+IQ4_XS",
)  # fmt: skip
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # 256-weight super-blocks
# (isa, VNNI on): AVX-512 and AVX2 run both the vpdpbusd (AVX-512 VNNI, AVX-VNNI) and the maddubs
# dot products.
VNNI_FLAG = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}
# (isa, mode): "vnni" and "plain" as above; "amx": AVX-512 with AMX tiles for 16 rows at a time (the
# rest of the rows on VNNI), where the kernel's probe found the OS grants them.
PATHS = [
    (isa, mode)
    for isa in native_build.supported_isas()
    for mode in (
        ("amx", "vnni", "plain") if isa == "avx512" else ("vnni", "plain") if isa in VNNI_FLAG else ("plain",)
    )
]


def amx_granted() -> bool:
    lib = quant_int8act.library("avx512")
    if lib is None:
        return False
    was = lib.llmserve_qi8_amx(-1)
    granted = bool(lib.llmserve_qi8_amx(1))
    lib.llmserve_qi8_amx(int(was) if granted else 1)
    return granted


def set_mode(lib, name: str, mode: str) -> None:
    if name in VNNI_FLAG:
        lib.llmserve_qi8_vnni(int(mode != "plain"))
    if name == "avx512":
        lib.llmserve_qi8_amx(int(mode == "amx"))


def reset_mode(lib, name: str) -> None:
    set_mode(lib, name, "amx")


@pytest.fixture(params=PATHS, ids=lambda p: f"{p[0]}{'' if p[1] == 'plain' else '-' + p[1]}")
def isa(request):
    name, mode = request.param
    lib = quant_int8act.library(name)
    if lib is None:
        pytest.fail(f"quant_int8act did not build for {name} (a C compiler is on this machine)")
    if name in VNNI_FLAG:
        has_vnni = VNNI_FLAG[name] in native_build.cpu_flags()
        assert lib.llmserve_qi8_vnni(int(mode != "plain")) == (mode != "plain" and has_vnni)
        if mode != "plain" and not has_vnni:
            pytest.skip(f"this CPU has no {VNNI_FLAG[name]}")
    if mode == "amx" and not amx_granted():
        pytest.skip("this CPU has no AMX, or the OS does not grant its tiles (the kernel's probe)")
    set_mode(lib, name, mode)
    assert lib.llmserve_qi8_amx(-1) == (mode == "amx")
    yield name
    reset_mode(lib, name)


def weight(fmt: str, n: int, k: int, seed: int) -> quant_gemm.QuantizedWeight:
    if "+" in fmt:  # the first rows in one format, the last third (at least one) in the other
        first, second = fmt.split("+")
        tail = max(1, n // 3) if n > 1 else 0
        parts = [weight(first, n - tail, k, seed)] + ([weight(second, tail, k, seed + 1)] if tail else [])
        return quant_gemm.concat_rows(parts)
    if fmt in K_QUANTS or fmt == "IQ4_NL":  # no quantizer in the gguf package: random blocks
        raw = random_k_blocks(n, k, fmt, seed)
    else:
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(n, k, generator=g) * k**-0.5).numpy()
        raw = quants.quantize(w, getattr(GGMLQuantizationType, fmt))
    return quant_gemm.from_gguf_blocks(fmt, raw, (n, k))


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :32] *= 50  # blocks of very different scales
    if m > 2:
        x[1, 32:64] = 0  # an all-zero block: scale 0
        x[2, 5] = 1e-30  # a tiny value beside normal ones
        x[2, 32:64] = 1e-39  # a block of subnormals: its scale is too, the block quantizes to 0
    return x


def float64_product(x: torch.Tensor, qw: quant_gemm.QuantizedWeight, bias) -> np.ndarray:
    """The same quantized activations (from the numpy quantizer below) times the dequantized weight
    in float64: the math without the fp32 roundings of the combination."""
    xs = x.double().numpy()
    m, k = xs.shape
    xb = xs.reshape(m, k // 32, 32).astype(np.float32)
    dx = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    inv = np.where(dx >= tiny, np.float32(1) / np.where(dx >= tiny, dx, 1), 0).astype(np.float32)
    q = np.clip(np.rint((xb * inv[..., None]).astype(np.float32)), -127, 127)
    xq = (q * dx[..., None].astype(np.float64)).reshape(m, k)
    w = qw.dequantize().double().numpy()
    out = xq @ w.T
    return out if bias is None else out + bias.double().numpy()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 64, 300])
@pytest.mark.parametrize("k,n,bias", [(576, 200, False), (64, 47, True), (256, 33, False), (32, 1, True)])
def test_int8_activation_gemm_is_the_documented_math(isa, fmt, m, k, n, bias):
    if any(f in K_QUANTS for f in fmt.split("+")) and k % 256:
        k = 256 * (k // 256 + 1)
    qw = weight(fmt, n, k, seed=m * 1000 + k + n)
    g = torch.Generator().manual_seed(m)
    b = torch.randn(n, generator=g) if bias else None
    x = activations(m, k, seed=m + k)
    got = quant_int8act.Int8ActLinear(qw, b, isa=isa)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), quant_int8act.reference(x, qw, b))
    want = float64_product(x, qw, b)
    scale = np.abs(x.double().numpy()).sum(1, keepdims=True) * float(qw.dequantize().abs().max())
    assert np.all(np.abs(got.numpy() - want) <= 1e-6 * scale + 1e-6 * np.abs(want))


def test_the_activation_quantization_is_the_documented_one(isa):
    x = activations(7, 96, seed=3)
    x[3, 0] = 127 * 0.5 / 127  # values that land on .5 after scaling: ties go to even
    q, dx, sx, dxs = quant_int8act.quantize_activations(x, isa)
    xb = x.numpy().reshape(7, 3, 32)
    want_dx = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    np.testing.assert_array_equal(dx.numpy(), want_dx)
    ok = want_dx >= np.finfo(np.float32).tiny
    inv = np.where(ok, np.float32(1) / np.where(ok, want_dx, 1), 0).astype(np.float32)
    want_q = np.clip(np.rint((xb * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(q.numpy(), want_q.reshape(7, 96))
    np.testing.assert_array_equal(sx.numpy(), want_q.astype(np.int32).sum(-1))
    np.testing.assert_array_equal(dxs.numpy(), (want_dx * want_q.astype(np.int32).sum(-1)).astype(np.float32))
    assert np.all(q.numpy()[1, 32:64] == 0) and dx[1, 1] == 0
    assert np.all(q.numpy()[2, 32:64] == 0) and 0 < dx[2, 1] < np.finfo(np.float32).tiny


def test_nan_and_infinity_quantize_as_documented(isa):
    """The SIMD quantizers (AVX-512, AVX2) against the documented rule in numpy, on the values the
    random activations never hold: a NaN is ignored by the block's max and quantizes to 0, an
    infinity makes the scale infinite (the block's finite values go to 0, the infinity itself to
    0 as inf * 0 is NaN), and a huge finite value saturates nothing (it sets the scale)."""
    x = activations(4, 128, seed=5)
    x[0, 3] = float("nan")  # a NaN among normal values
    x[0, 40] = float("inf")
    x[1, 64:96] = float("nan")  # a block of NaNs: scale 0, all quants 0
    x[2, 7] = -float("inf")
    x[2, 100] = float("nan")
    x[3, 0] = 3e38  # a finite value near the top: its block's scale is finite
    q, dx, sx, dxs = quant_int8act.quantize_activations(x, isa)
    xb = x.numpy().reshape(4, 4, 32)
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.abs(xb)
        amax = np.where(np.isnan(a), 0, a).max(-1).astype(np.float32)
        want_dx = (amax / np.float32(127)).astype(np.float32)
        ok = want_dx >= np.finfo(np.float32).tiny
        inv = np.where(ok, np.float32(1) / np.where(ok, want_dx, 1), 0).astype(np.float32)
        r = np.rint((xb * inv[..., None]).astype(np.float32))
        want_q = np.where(np.isnan(r), 0, np.clip(r, -127, 127)).astype(np.int8)
    np.testing.assert_array_equal(dx.numpy(), want_dx)
    np.testing.assert_array_equal(q.numpy(), want_q.reshape(4, 128))
    np.testing.assert_array_equal(sx.numpy(), want_q.astype(np.int32).sum(-1))
    assert np.isinf(dx[0, 1]) and np.all(q.numpy()[1, 64:96] == 0) and dx[1, 2] == 0
    assert q[0, 0] != 0 and q[0, 3] == 0 and q[3, 0] == 127


def gate_up_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """``[gate | up]`` rows of an MLP (2k each): blocks of very different scales, gates far out on
    both sides of SiLU's bend, a zero block, subnormals, NaNs and infinities."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k, generator=g) * 3
    x[:, :32] *= 40
    x[:, k : k + 32] *= 0.01
    x[0, 40:72] = torch.linspace(-100, 100, 32)  # exp's clamp below -87, sigmoid 1 above
    if m > 3:
        x[1, 32:64] = 0  # act 0: a zero block, scale 0
        x[1, k + 96 : k + 128] = 0
        x[2, 64:96] = 1e-39  # subnormal gates
        x[3, 5], x[3, 6], x[3, 7] = float("nan"), float("inf"), -float("inf")
        x[3, k + 8] = float("nan")
        x[3, k + 40] = float("inf")
    return x


def _fp32_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.uint32)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("name", native_build.supported_isas())
def test_the_fused_gated_quantization_is_that_of_the_elementwise_kernels_rows(name, gelu):
    """The down projection's fused quantization (quant_int8act.c's quantize_glu_row: SiLU- or
    GELU-tanh-and-multiply made a block at a time, never written) gives the quants and scales,
    bit for bit, of quantizing the rows elementwise.c's kernel writes, on each instruction set."""
    k = 320  # 10 blocks: a row's tail past the SIMD widths' multiples too
    x = gate_up_rows(9, k, seed=2)
    kernel = native_elementwise.gelu_tanh_and_mul if gelu else native_elementwise.silu_and_mul
    rows = kernel(x, isa=name)
    want = quant_int8act.quantize_activations(rows, name)
    got = quant_int8act.quantize_glu_activations(x, gelu, name)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype
        if w.dtype is torch.float32:
            np.testing.assert_array_equal(_fp32_bits(g), _fp32_bits(w))
        else:
            assert torch.equal(g, w)
    assert (got[0] != 0).any() and (got[0][1, 32:64] == 0).all()


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_1", "Q5_0", "Q6_K", "Q4_K", "Q5_0+Q6_K"))
def test_a_fused_down_projection_is_the_projection_of_the_kernels_rows(isa, fmt, gelu):
    """``Int8ActLinear.glu`` (the decoder loop's down projection with SiLU / GELU-tanh inside its
    activation quantization) against the linear of elementwise.c's rows: the same bits at 1 to 300
    rows (VNNI, the tiles from 16-64, a prefill's several row items), 1 and 2 threads; with a bias;
    a projection of row segments; rows read from a wider buffer are the same."""
    k, n = 512, 70
    qw = weight(fmt, n, k, seed=21)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    lin = quant_int8act.Int8ActLinear(qw, bias, isa=isa)
    kernel = native_elementwise.gelu_tanh_and_mul if gelu else native_elementwise.silu_and_mul
    x = gate_up_rows(300, k, seed=7)

    def check():
        for m in (1, 5, 17, 64, 300):
            want = lin(kernel(x[:m], isa=isa))
            got = lin.glu(x[:m], gelu)
            np.testing.assert_array_equal(_fp32_bits(got), _fp32_bits(want))
        assert torch.equal(lin.glu(x[40:45], gelu), lin.glu(x, gelu)[40:45])

    _at_one_and_two_threads(check)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("fmts", [("Q4_K", "Q6_K"), ("Q5_0", "Q8_0"), ("Q8_0", "Q4_1")], ids="-".join)
def test_a_fused_mlp_is_its_three_kernels(isa, fmts, gelu):
    """``quant_int8act.mlp`` (quant_int8act.c's llmserve_qi8_mlp: gate/up outputs a panel pair at a
    time into a tile, the products quantized there as the down projection's rows, never stored)
    against the gate/up linear, elementwise.c's kernel and the down linear: the same bits at 1 to
    600 rows (VNNI, the tiles, several row chunks), biases on both, 1 and 2 threads. Row segments
    and widths not a multiple of 64 are refused."""
    gf, df = fmts
    h, inter, n = 256, 256, 70
    g = torch.Generator().manual_seed(5)
    gate_up = quant_int8act.Int8ActLinear(
        weight(gf, 2 * inter, h, 1), torch.randn(2 * inter, generator=g), isa=isa
    )
    down = quant_int8act.Int8ActLinear(weight(df, n, inter, 2), torch.randn(n, generator=g), isa=isa)
    kernel = native_elementwise.gelu_tanh_and_mul if gelu else native_elementwise.silu_and_mul
    x = activations(600, h, seed=8)

    def check():
        for m in (1, 5, 17, 64, 600):
            want = down(kernel(gate_up(x[:m]), isa=isa))
            np.testing.assert_array_equal(
                _fp32_bits(quant_int8act.mlp(gate_up, down, x[:m], gelu)), _fp32_bits(want)
            )

    _at_one_and_two_threads(check)
    mixed = quant_int8act.Int8ActLinear(weight("Q5_0+Q8_0", 2 * inter, h, 1), isa=isa)
    narrow = quant_int8act.Int8ActLinear(weight("Q8_0", n, 96, 2), isa=isa)  # 96: not a multiple of 64
    wide = quant_int8act.Int8ActLinear(weight("Q8_0", 192, h, 1), isa=isa)
    assert (
        quant_int8act.fused_mlp_fn(mixed, down) is None and quant_int8act.fused_mlp_fn(wide, narrow) is None
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_is_bit_equal_alone_batched_at_any_thread_count_and_isa(fmt):
    k = 512  # a K-quant's rows are whole super-blocks of 256
    qw = weight(fmt, 300, k, seed=7)
    x = activations(70, k, seed=1)
    threads = torch.get_num_threads()
    results = []
    try:
        for name, mode in PATHS:
            lib = quant_int8act.library(name)
            set_mode(lib, name, mode)
            lin = quant_int8act.Int8ActLinear(qw, isa=name)
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                results.append(lin(x))
                alone = torch.cat([lin(x[i : i + 1]) for i in range(0, 70, 9)])
                assert torch.equal(alone, results[-1][0:70:9])
                assert torch.equal(lin(x[3:20]), results[-1][3:20])
                assert torch.equal(lin(x[5:70]), results[-1][5:70])
            reset_mode(lib, name)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)


def _at_one_and_two_threads(check) -> None:
    """Run ``check`` with torch's (and so the kernels') thread count at 1, then 2; restore it."""
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            check()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K", "Q2_K", "IQ4_XS", "Q5_0+Q6_K"))
def test_a_long_prompts_rows_over_several_work_items_are_the_documented_math(isa, fmt):
    """A prefill-sized call: on the tiles its work items take 512 rows, each 16-row group reading
    its activation scales from the call's copy by group (quant_int8act.c's dxt); 1100 rows are two
    whole items and a ragged one (4 groups, then 12 rows on VNNI). Every row is the reference's
    bits at 1 and 2 threads, and the same bits when the call starts 517 rows in (every group
    boundary moved)."""
    k, n, m = 512, 40, 1100
    qw = weight(fmt, n, k, seed=11)
    x = activations(m, k, seed=3)
    lin = quant_int8act.Int8ActLinear(qw, isa=isa)
    want = quant_int8act.reference(x, qw)

    def check():
        got = lin(x)
        np.testing.assert_array_equal(got.numpy(), want)
        assert torch.equal(lin(x[517:]), got[517:])

    _at_one_and_two_threads(check)


@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q5_0+Q8_0"))
@pytest.mark.parametrize("k", [96, 224])
def test_an_odd_number_of_blocks_on_the_tiles_is_the_documented_math(isa, fmt, k):
    """The one-scale formats' tiles take their blocks two at a time (quant_int8act.c's
    rows_amx_pairs): K of 3 and 7 blocks leave the last one alone. 80 rows are 5 groups of 16, at
    1 and 2 threads; every row the reference's bits."""
    n, m = 40, 80
    qw = weight(fmt, n, k, seed=5)
    x = activations(m, k, seed=9)
    lin = quant_int8act.Int8ActLinear(qw, isa=isa)
    want = quant_int8act.reference(x, qw)
    _at_one_and_two_threads(lambda: np.testing.assert_array_equal(lin(x).numpy(), want))


@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"))
def test_fp16_packed_scales_give_the_same_bits(isa, fmt):
    """A GGUF file's scales are fp16 values: packed as fp16 (fewer bytes), read back exactly."""
    qw = weight(fmt, 45, 96, seed=4)
    half = quant_int8act.Int8ActLinear(qw, isa=isa)
    full = quant_int8act.Int8ActLinear(qw, isa=isa, half_scales=False)
    assert half.half_scales and not full.half_scales
    assert half.packed.numel() < full.packed.numel()
    x = activations(11, 96, seed=5)
    assert torch.equal(half(x), full(x))
    k_quant = weight("Q4_K", 8, 256, seed=1)  # expanded, d = d_super * scale6: not fp16 values
    assert not quant_int8act.Int8ActLinear(k_quant, isa=isa, super_blocks=False).half_scales
    with pytest.raises(ValueError, match="not all fp16 values"):
        quant_int8act.Int8ActLinear(k_quant, isa=isa, half_scales=True, super_blocks=False)


@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_1", "Q5_0", "Q5_0+Q8_0"))
def test_only_its_own_outputs_are_written(isa, fmt):
    n, k, m = 37, 64, 5
    qw = weight(fmt, n, k, seed=3)
    lin = quant_int8act.Int8ActLinear(qw, isa=isa)
    x = activations(m, k, seed=2)
    buf = torch.full((m, n + 11), 12345.0)
    lib = quant_int8act.library(isa)
    rc = lib.llmserve_qi8_gemm(
        lin.code, x.data_ptr(), m, k, k, lin.packed.data_ptr(), n, None,
        buf.data_ptr(), n + 11, 2,
    )  # fmt: skip
    assert rc == 0
    assert torch.all(buf[:, n:] == 12345.0)
    np.testing.assert_array_equal(buf[:, :n].numpy(), quant_int8act.reference(x, qw))


def test_bad_input_is_refused(isa):
    qw = weight("Q8_0", 8, 64, seed=1)
    lin = quant_int8act.Int8ActLinear(qw, isa=isa)
    with pytest.raises(ValueError, match="rows of 64"):
        lin(torch.randn(2, 32))
    x64 = torch.randn(3, 64, dtype=torch.float64)  # other dtypes and strides: as their fp32 rows
    assert torch.equal(lin(x64), lin(x64.float()))
    wide = torch.randn(3, 128)
    assert torch.equal(lin(wide[:, ::2]), lin(wide[:, ::2].contiguous()))
    assert lin(torch.randn(0, 64)).shape == (0, 8)
    lib = quant_int8act.library(isa)
    y = torch.full((1, 8), 7.0)
    x = torch.randn(1, 64)
    # 7, 15, 24, 31: no such form; 16 (IQ4_XS), 23 (Q2_K): not whole super-blocks
    for fmt, k in ((7, 64), (15, 64), (16, 64), (23, 288), (24, 256), (31, 256), (-1, 64), (0, 48), (5, 48)):
        assert (
            lib.llmserve_qi8_gemm(
                fmt, x.data_ptr(), 1, k, 64, lin.packed.data_ptr(), 8, None, y.data_ptr(), 8, 1
            )
            == -1
        )
    assert torch.all(y == 7.0)  # a refused call writes nothing
    q6 = quant_gemm.from_gguf_blocks("Q6_K", random_k_blocks(4, 256, "Q6_K", 0), (4, 256))
    other = quant_gemm.QuantizedWeight("IQ2_XXS", q6.q, q6.d, None)  # a format with no int8 form
    assert quant_int8act.supports("Q6_K") and not quant_int8act.supports("IQ2_XXS")
    with pytest.raises(ValueError, match="no int8-activation kernel for IQ2_XXS"):
        quant_int8act.Int8ActLinear(other, isa=isa)
    q2 = weight("Q2_K", 4, 256, seed=0)  # Q2_K has no expanded form: its super-blocks or nothing
    assert quant_int8act.supports("Q2_K")
    for bare in (quant_gemm.QuantizedWeight("Q2_K", q2.q, q2.d, q2.m), q2):
        with pytest.raises(ValueError, match="Q2_K runs from its file's super-block scales only"):
            quant_int8act.Int8ActLinear(bare, isa=isa, super_blocks=bare is not q2)


@pytest.mark.parametrize("fmt,file_bytes", [("Q5_0", 22), ("Q5_1", 24)])
def test_5_bit_blocks_are_packed_at_the_files_size(isa, fmt, file_bytes):
    """Q5_0 / Q5_1 are served at the bytes a weight the file holds them in (nibbles, a plane of
    fifth bits, fp16 scales and minimums), not as bytes; every quant value 0..31 in every one of a
    block's 32 positions comes back through the fifth-bit plane (a misplaced bit changes sums)."""
    n, k = 64, 64
    qw = weight(fmt, n, k, seed=2)
    q = torch.arange(n * k).remainder(32).reshape(n, k).to(torch.uint8)  # every value, every place
    q = torch.roll(q, shifts=1, dims=0) ^ (torch.arange(k) % 2).to(torch.uint8)[None, :]
    if fmt == "Q5_0":
        q = (q.to(torch.int16) - 16).to(torch.int8).view(torch.uint8)
    qw = quant_gemm.QuantizedWeight(fmt, q.contiguous(), qw.d, qw.m)
    lin = quant_int8act.Int8ActLinear(qw, isa=isa)
    assert lin.half_scales and lin.packed.numel() == n * (k // 32) * file_bytes
    x = activations(5, k, seed=9)
    np.testing.assert_array_equal(lin(x).numpy(), quant_int8act.reference(x, qw))


# bytes a super-block of 256 weights: the file's, and the kernel's (a column's header + quants;
# Q3_K's 3-bit quants take a nibble each)
K_BYTES = {
    "Q2_K": (84, 84),
    "Q3_K": (110, 146),
    "Q4_K": (144, 148),
    "Q5_K": (176, 180),
    "Q6_K": (210, 210),
    "IQ4_XS": (136, 138),
}


def test_the_unpacking_thresholds_follow_the_cpu_vendor():
    """Where a work item unpacks its panel once (quant_int8act.UNPACK_CLASSES): on an AMD CPU Q4_K
    from 128 rows and a short-K Q6_K from 32 (measured on a Zen 4), elsewhere the Xeon's 32 and 6;
    the vendor read here from /proc/cpuinfo, the kernel's from cpuid."""
    vendor = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            vendor = line.split(":", 1)[1].strip()
            break
    want = [32, 16, 128, 32, 6] if vendor == "AuthenticAMD" else [32, 16, 32, 6, 6]
    for name in native_build.supported_isas():
        assert quant_int8act.unpack_from(isa=name) == want, name


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quants_are_served_from_their_super_blocks(isa, fmt):
    """Q4_K / Q5_K / Q6_K packed from the file's super-block scales (fp16 d, dmin and the 6- or
    8-bit integers; the kernel makes each block's scales) at about the file's size, not as the
    expanded Q4_1 / U8_1 / I8_16 forms; every quant value in every position of a super-block comes
    back (a misplaced nibble or high bit changes sums), bit-equal to the expanded form and to the
    reference. A scale set that does not make the weight's scales is refused."""
    n, k = 64, 512  # whole panels of 32 columns
    qw = weight(fmt, n, k, seed=6)
    top = {"Q2_K": 4, "Q3_K": 8, "Q4_K": 16, "Q5_K": 32, "Q6_K": 64, "IQ4_XS": 16}[fmt]
    q = torch.arange(n * k).remainder(top).reshape(n, k)
    q = torch.roll(q, shifts=1, dims=0) ^ (torch.arange(k) % 2)[None, :]
    if fmt in ("Q3_K", "Q6_K"):
        q = q - top // 2
    if fmt == "IQ4_XS":  # every table entry in every position
        q = torch.from_numpy(quant_gemm.IQ4_NL_VALUES.astype(np.int64))[q]
    qw = quant_gemm.QuantizedWeight(
        fmt, q.to(torch.int8).view(torch.uint8).contiguous(), qw.d, qw.m, sup=qw.sup
    )
    lin = quant_int8act.Int8ActLinear(qw, isa=isa)
    file_bytes, ours = K_BYTES[fmt]
    assert lin.code == quant_int8act.K_FORMATS[fmt]
    assert lin.packed.numel() == n * (k // 256) * ours and ours <= file_bytes * 1.33
    # 6 and 40 rows: each pass of rows unpacks its own quants (a single row, rows_k's or rows_simd's
    # passes; from 16 rows rows_wide's), or the item unpacks the panel once and runs its passes over
    # the bytes (AVX-512 VNNI): the thresholds as shipped, then every item on each path
    expanded = None
    if fmt not in quant_int8act.K_ONLY:  # the expanded form: the same bits, more bytes
        expanded = quant_int8act.Int8ActLinear(qw, isa=isa, super_blocks=False)
        assert expanded.code != lin.code
        assert expanded.packed.numel() > 1.25 * lin.packed.numel()
    shipped = quant_int8act.unpack_from(isa=isa)
    try:
        for thresholds in (shipped, [1] * len(shipped), [1 << 20] * len(shipped)):
            quant_int8act.unpack_from(thresholds, isa=isa)
            for m in (6, 40):
                x = activations(m, k, seed=8)
                got = lin(x)
                np.testing.assert_array_equal(got.numpy(), quant_int8act.reference(x, qw))
                if expanded is not None:
                    assert torch.equal(got, expanded(x))
    finally:
        quant_int8act.unpack_from(shipped, isa=isa)
    bad = quant_gemm.QuantizedWeight(fmt, qw.q, qw.d * 2, qw.m, sup=qw.sup)
    with pytest.raises(ValueError, match="super-block scales do not make"):
        quant_int8act.Int8ActLinear(bad, isa=isa)
    if fmt in ("Q2_K", "IQ4_XS"):  # a quant its packed form cannot hold (a crumb, a table index)
        odd = qw.q.clone()
        odd[5, 300] = 4 if fmt == "Q2_K" else 0  # 0 is no IQ4_NL table value
        with pytest.raises(RuntimeError, match="refused to pack"):
            quant_int8act.Int8ActLinear(quant_gemm.QuantizedWeight(fmt, odd, qw.d, qw.m, sup=qw.sup), isa=isa)


def segments_header(packed: torch.Tensor) -> torch.Tensor:
    """A segmented weight's int64 header words (row_segments.h), a copy to edit."""
    count = int(packed[:8].view(torch.int64))
    return packed[: 8 * (1 + 3 * count)].view(torch.int64).clone()


@pytest.mark.parametrize("kernel", ["int8", "fp32"])
def test_a_bad_segment_header_is_refused_and_nothing_written(kernel):
    """A fused projection of row ranges in different formats runs each range on its own format's
    kernel; a header that does not describe the weight (no segments, too many, a nested or unknown
    code, rows not summing to n, a k its format refuses) is refused before a single output."""
    qw = weight("Q5_0+Q8_0", 48, 64, seed=1)
    lin = quant_int8act.Int8ActLinear(qw) if kernel == "int8" else quant_gemm.QuantLinear(qw)
    assert (lin.code if kernel == "int8" else lin._code) == quant_gemm.SEGMENTS
    good = segments_header(lin.packed)
    assert good.tolist()[:3] == [2, good[1].item(), 32] and good[5].item() == 16
    x = torch.randn(2, 64)
    y = torch.full((2, 48), 7.0)
    code = quant_gemm.SEGMENTS

    def call(header: torch.Tensor, k: int = 64) -> int:
        buf = lin.packed.clone()
        buf[: 8 * header.numel()] = header.view(torch.uint8)
        return lin._gemm(code, x.data_ptr(), 2, k, 64, buf.data_ptr(), 48, None, y.data_ptr(), 48, 1)

    bad = []
    for word, value in ((0, 0), (0, 17), (1, code), (1, 99), (2, 31), (2, 0), (5, 17)):
        h = good.clone()
        h[word] = value
        bad.append(h)
    for h in bad:
        assert call(h) == -1, h.tolist()
    assert call(good, k=48) == -1  # not whole blocks of either format
    assert torch.all(y == 7.0)
    assert call(good) == 0 and torch.equal(y, lin(x))


_PROBE = """
import sys, torch
from kernels.cpu import quant_int8act
from tests.test_quant_int8act import activations, weight
lib = quant_int8act.library("avx512")
lin = quant_int8act.Int8ActLinear(weight("Q5_0", 64, 256, seed=3), isa="avx512")
y = lin(activations(48, 256, seed=2))  # 48 rows: the tiles' size, where granted
print(int(lib.llmserve_qi8_amx(-1)), quant_int8act.variant("avx512"))
torch.save(y, sys.argv[1])
"""


@pytest.mark.skipif(
    "avx512" not in native_build.supported_isas(), reason="the AMX path is in the avx512 build"
)
@pytest.mark.parametrize("env", ["LLMSERVE_AMX_PROBE_FAULT", "LLMSERVE_AMX"])
def test_amx_is_used_only_where_the_probe_succeeds(tmp_path, env):
    """The probe's child faulting (as on a VM that advertises AMX and faults on it), or
    ``LLMSERVE_AMX=0``: the process goes on with the tiles off and the same bits."""
    import os
    import subprocess
    import sys

    def run(extra: dict) -> tuple[str, torch.Tensor]:
        out = tmp_path / f"y{len(extra)}.pt"
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, str(out)],
            env={**os.environ, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip(), torch.load(out)

    on, y_on = run({})
    off, y_off = run({env: "1" if env.endswith("FAULT") else "0"})
    assert off.split()[0] == "0" and "AMX" not in off
    assert torch.equal(y_on, y_off)
    assert on.split()[0] == str(int(amx_granted())) and ("AMX" in on) == amx_granted()
