"""bf16 weights on AMX-BF16 tiles with exactly split fp32 activations (``small_gemm.c``, where the OS
grants the tiles): the split x = x1 + x2 + x3 and its edges, the kernel bit-equal to the numpy
statement of the tile's order (``native_gemm.amx_bf16_reference``) on adversarial inputs, and
unequal to the statement's wrong variants (a part dropped, the parts reordered, the SDM's older
per-pair order), a row's bits the same alone and in any batch (tiles and the one-row emulation
alike) and thread count, and the FMA path kept where the tiles are off (``LLMSERVE_AMX=0``)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels.cpu import native_build, native_gemm

AMX = "avx512" in native_build.supported_isas() and native_gemm.bf16_amx("avx512")
needs_amx = pytest.mark.skipif(
    not AMX, reason="the OS grants no AMX-BF16 tiles here (the FMA path's tests cover it)"
)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def same(a, b) -> bool:
    return np.array_equal(
        np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)
    )


def test_the_split_is_exact_above_the_smallest_normal_and_drops_below_it():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * 2.0 ** rng.integers(-90, 90, 20000)).astype(np.float32)
    x1, x2, x3 = native_gemm.bf16_split(x)
    for p in (x1, x2, x3):
        assert np.all(p.view(np.uint32) & 0xFFFF == 0)  # each part a bf16
    assert np.array_equal(x1.astype(np.float64) + x2 + x3, x.astype(np.float64))
    # the edge: x's last bits below 2^-126 would make a subnormal part, which the tile reads as 0
    edge = np.float32(2.0**-110 * (1 + 2.0**-23))
    e1, e2, e3 = (p[0] for p in native_gemm.bf16_split(np.array([edge])))
    assert e3 == 0 and float(e1) + float(e2) == 2.0**-110
    inf = native_gemm.bf16_split(np.array([np.inf, -np.inf, np.nan], np.float32))
    assert np.isinf(inf[0][:2]).all() and np.isnan(inf[0][2]) and not inf[1].any() and not inf[2].any()


def cases():
    """(x, w bf16, bias): random; exponents spread over 2^+-40; sums that cancel; tiny values whose
    products and chains cross 2^-126 (FTZ)."""
    rng = np.random.default_rng(1)
    out = []
    for m, n, k in ((1, 40, 100), (5, 33, 64), (16, 64, 96), (17, 70, 200), (33, 32, 31)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).to(torch.bfloat16)
        out.append((x, w, rng.standard_normal(n).astype(np.float32)))
    x = (rng.standard_normal((9, 128)) * 2.0 ** rng.integers(-40, 40, (9, 128))).astype(np.float32)
    w = torch.from_numpy(
        (rng.standard_normal((48, 128)) * 2.0 ** rng.integers(-40, 40, (48, 128))).astype(np.float32)
    )
    out.append((x, w.to(torch.bfloat16), None))
    base = rng.standard_normal((6, 64)).astype(np.float32)  # x and -x in the two halves of k
    x = np.concatenate([base, -base * np.float32(1 + 2.0**-20)], axis=1)
    wt = torch.from_numpy(rng.standard_normal((40, 64)).astype(np.float32)).to(torch.bfloat16)
    out.append((x, torch.cat([wt, wt], dim=1), None))
    x = (rng.standard_normal((7, 96)) * 2.0**-62).astype(np.float32)
    w = torch.from_numpy((rng.standard_normal((36, 96)) * 2.0**-63).astype(np.float32)).to(torch.bfloat16)
    out.append((x, w, None))
    return out


@needs_amx
@pytest.mark.parametrize("case", range(8))
def test_the_tiles_equal_the_numpy_statement_bit_for_bit_and_its_wrong_variants_do_not(case):
    x, w, b = cases()[case]
    lin = native_gemm.NativeLinear(w, None if b is None else torch.from_numpy(b), isa="avx512")
    assert lin.amx and lin.packed.numel() == native_gemm.library("avx512").llmserve_gemm_bf16_amx_size(
        *w.shape
    )
    got = lin(torch.from_numpy(x)).numpy()
    assert same(got, native_gemm.amx_bf16_reference(x, bits(w), b))
    if case < 5:  # the wrong math differs (tiny and cancelling cases may tie by chance)
        for wrong in (dict(parts_order=(0, 1)), dict(parts_order=(2, 1, 0)), dict(paired=True)):
            assert not same(got, native_gemm.amx_bf16_reference(x, bits(w), b, **wrong)), wrong


@needs_amx
@pytest.mark.parametrize("k,total", [(416, 70), (1408, 300), (4000, 130)])
def test_a_row_has_the_same_bits_alone_in_any_batch_and_thread_count(k, total):
    """A row's 3 parts are 3 part-rows, 16 a tile (a row's parts may straddle two tiles: rows 5, 10,
    ...), the last tile with fewer, two tiles at a time, in blocks of up to 30 tiles (160 rows: 300
    rows at k = 1408 are two blocks; fewer at a long k: 12 tiles at k = 4000, so 130 rows are
    blocks of 64, 64 and 2 rows; a block is whole rows), one pair of tiles keeping its sums in the
    tiles over all of k, and k chunks of 256: every way is the same math."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(100, k, generator=g).to(torch.bfloat16)
    lin = native_gemm.NativeLinear(w, torch.randn(100, generator=g), isa="avx512")
    x = torch.randn(total, k, generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in (2, 3, 5, 6, 11, 16, 17, 33, 41, 70, total):
                assert torch.equal(lin(x[:rows]), alone[:rows]), (t, rows)
                assert torch.equal(lin(x[total - rows :]), alone[total - rows :]), (t, rows)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_the_tiles_are_close_to_a_float64_matmul_and_reads_one_hot_rows_back():
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(300, 896, generator=g) * 896**-0.5).to(torch.bfloat16)
    x = torch.randn(40, 896, generator=g)
    got = native_gemm.NativeLinear(w, isa="avx512")(x)
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=2e-5, atol=2e-5)
    eye = native_gemm.NativeLinear(torch.eye(64).to(torch.bfloat16), isa="avx512")
    vals = torch.randn(5, 64, generator=g) * 2.0 ** torch.randint(-30, 30, (5, 64), generator=g)
    assert torch.equal(eye(vals), vals)  # x1 + x2 + x3 = x exactly, summed from 0 in that order


def test_the_fma_path_where_the_tiles_are_off():
    """Turned off in the process (new weights take the FMA panels) and by ``LLMSERVE_AMX=0``: the
    bf16 result is the fp32 GEMM's on the widened weights, as on a machine without AMX."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(50, 96, generator=g).to(torch.bfloat16), torch.randn(7, 96, generator=g)
    was = native_gemm.bf16_amx()
    native_gemm.bf16_amx(on=False)
    try:
        lin = native_gemm.NativeLinear(w)
    finally:
        native_gemm.bf16_amx(on=True)
    assert not lin.amx and native_gemm.bf16_amx() == was
    assert torch.equal(lin(x), native_gemm.NativeLinear(w.float())(x))
    code = "from kernels.cpu import native_gemm as g; print(int(g.bf16_amx()), g.bf16_path())"
    # the tiles off by the switch, or the probe's child faulting as on a VM that advertises AMX
    for var, value in (("LLMSERVE_AMX", "0"), ("LLMSERVE_AMX_PROBE_FAULT", "1")):
        env = {**os.environ, var: value}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.startswith("0 ") and "AMX" not in out.stdout, var
