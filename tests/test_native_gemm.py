"""The native GEMM (``kernels/cpu/native/small_gemm.c`` through ``kernels/cpu/native_gemm.py``), on
every instruction set this CPU runs: against a float64 matmul (an independent reader), a row's
result bit-equal alone and in any batch and at any thread count, only its own columns written,
and the linear-backend choice that puts it in the model."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import linear as cpu_linear
from kernels.cpu import native_build, native_gemm

ISAS = native_build.supported_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    if native_gemm.library(request.param) is None:
        pytest.fail(f"the native GEMM did not build for {request.param} (a C compiler is on this machine)")
    return request.param


def exact(x, w, b=None):
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


# N around every panel width (12..48 columns: 16 x 3 on AVX-512, 8 x 2 with AVX2, 4 x 2 generic),
# K small and large; M across the row blocks (8 on AVX-512, 6 elsewhere) and the 256-row items.
@pytest.mark.parametrize("m", [1, 5, 6, 7, 8, 9, 16, 63, 64, 257, 300])
@pytest.mark.parametrize(
    "k,n,bias", [(512, 768, False), (64, 47, True), (33, 200, True), (1408, 49, False), (8, 1, True)]
)
def test_native_gemm_equals_a_float64_matmul(isa, m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k, generator=g) * k**-0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    got = native_gemm.NativeLinear(w, b, isa=isa)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, exact(x, w, b), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=2e-5, atol=2e-5)


def test_native_gemm_takes_empty_batches_strided_rows_and_leading_dims(isa):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 32, generator=g)
    lin = native_gemm.NativeLinear(w, isa=isa)
    assert lin(torch.randn(0, 32)).shape == (0, 96)
    x = torch.randn(10, 64, generator=g)[:, 16:48]  # a column slice: rows 64 floats apart
    assert x.stride() == (64, 1)
    torch.testing.assert_close(lin(x), exact(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 32, generator=g)
    torch.testing.assert_close(lin(x3), exact(x3, w), rtol=1e-5, atol=1e-5)
    xt = torch.randn(32, 7, generator=g).T  # columns apart: copied, not misread
    torch.testing.assert_close(lin(xt), exact(xt, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows of 32"):
        lin(torch.randn(4, 31))
    with pytest.raises(ValueError, match="2-D fp32"):
        native_gemm.NativeLinear(w.double(), isa=isa)


@pytest.mark.parametrize("k,n", [(512, 768), (200, 130), (1408, 512)])
def test_a_rows_result_is_bit_equal_in_any_batch_and_thread_count(isa, k, n):
    """Each output is one chain over k in order whatever the row block, the 256-row item, the panel
    split across threads or the batch: torch.equal, not a tolerance."""
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g) * k**-0.5
    b = torch.randn(n, generator=g)
    lin = native_gemm.NativeLinear(w, b, isa=isa)
    rows = torch.randn(300, k, generator=g)
    alone = torch.cat([lin(rows[i : i + 1]) for i in range(0, 300, 23)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for m in (300, 257, 17, 9, 8, 2):
                got = lin(rows[:m])
                for j, i in enumerate(range(0, m, 23)):
                    assert torch.equal(got[i], alone[j]), f"row {i} of {m} at {t} threads"
            # a row's place in the batch does not matter either
            perm = torch.randperm(300, generator=g)
            assert torch.equal(lin(rows[perm])[torch.argsort(perm)], lin(rows))
    finally:
        torch.set_num_threads(threads)


def test_the_gemm_writes_only_its_own_columns(isa):
    """Through the C entry directly, into rows wider than N: the last panel's padded columns (past
    N) and the gap between rows keep their sentinel."""
    lib = native_gemm.library(isa)
    nb = lib.llmserve_gemm_panel_width()
    n, k, m, ldy = nb + 3, 20, 9, nb + 3 + 11
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    packed = torch.empty(2 * nb * k)
    lib.llmserve_gemm_pack_f32(w.data_ptr(), n, k, packed.data_ptr())
    assert torch.equal(packed.view(2, k, nb)[1, :, 3:], torch.zeros(k, nb - 3))  # columns past N are zero
    y = torch.full((m, ldy), float("nan"))
    lib.llmserve_gemm_f32(x.data_ptr(), m, k, k, packed.data_ptr(), n, None, y.data_ptr(), ldy, 2)
    torch.testing.assert_close(y[:, :n], exact(x, w), rtol=1e-5, atol=1e-5)
    assert torch.isnan(y[:, n:]).all()


# --- the choice of backend ---------------------------------------------------------------------


def test_auto_takes_the_native_gemm_where_it_measured_faster(monkeypatch):
    cpu = torch.device("cpu")
    want = "native" if native_build.chosen_isa() in native_gemm.FASTER_THAN_ONEDNN else None
    got = cpu_linear.resolve_linear_backend("auto", cpu, torch.float32)
    if want:
        assert got == "native"
        assert isinstance(cpu_linear.make_linear(got, torch.randn(8, 4)), native_gemm.NativeLinear)
    else:
        assert got in ("onednn", "dense")
    # bf16/fp16 weights take their own packing (tests/test_half_weights.py); never CUDA
    assert cpu_linear.resolve_linear_backend("auto", cpu, torch.bfloat16) != "native"
    assert cpu_linear.resolve_linear_backend("auto", cpu, torch.float16) != "native"
    assert cpu_linear.resolve_linear_backend("auto", torch.device("cuda"), torch.float32) == "dense"
    with pytest.raises(ValueError, match="'native' is unavailable: .*fp32, bf16 or fp16"):
        cpu_linear.resolve_linear_backend("native", cpu, torch.float64)


def test_the_generic_build_runs_only_when_named(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "generic")
    cpu = torch.device("cpu")
    assert "measured slower" in native_gemm.unusable_reason(torch.float32)
    assert cpu_linear.resolve_linear_backend("auto", cpu, torch.float32) != "native"
    assert cpu_linear.resolve_linear_backend("native", cpu, torch.float32) == "native"
    lin = cpu_linear.make_linear("native", torch.randn(20, 12))
    assert lin.packed.numel() == 3 * 8 * 12  # 20 columns in the generic build's panels of 4 lanes x 2 vectors


def test_a_native_gemm_that_computes_wrong_numbers_is_never_served(monkeypatch, caplog):
    if native_gemm.unusable_reason(torch.float32) is not None:
        pytest.skip(f"the native GEMM does not serve auto here: {native_gemm.unusable_reason(torch.float32)}")
    real = cpu_linear._probe_ok
    monkeypatch.setattr(
        cpu_linear,
        "_probe_ok",
        lambda dtype, kind: kind is not native_gemm.NativeLinear and real(dtype, kind),
    )

    with caplog.at_level(logging.INFO, logger="kernels.cpu.linear"):
        assert cpu_linear.resolve_linear_backend("auto", torch.device("cpu"), torch.float32) != "native"
    assert "probe did not match" in caplog.text
    with pytest.raises(ValueError, match="'native' is unavailable"):
        cpu_linear.resolve_linear_backend("native", torch.device("cpu"), torch.float32)


def test_no_build_falls_back(monkeypatch):
    monkeypatch.setattr(native_gemm, "_library", lambda isa: None)
    assert "no native build" in native_gemm.unusable_reason(torch.float32)
    assert cpu_linear.resolve_linear_backend("auto", torch.device("cpu"), torch.float32) in (
        "onednn",
        "dense",
    )
    with pytest.raises(RuntimeError, match="no build"):
        native_gemm.NativeLinear(torch.randn(4, 4))
