"""benchmarks/gemm_roof.py times each packed linear through its own GEMM entry into a kept output;
that call must be the linear's own result for every kind the engine builds (it once passed a format
code to the float GEMMs, which take none, and the bf16 directory's linears could not be timed)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gemm_roof import into_kept_output
from kernels.cpu import native_gemm, quant_gemm, quant_int8act
from tests.test_quant_int8act import activations, weight


def linears():
    if native_gemm.library() is None:
        pytest.skip("the native GEMM has no build here (no C compiler)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 64, generator=g)
    out = {
        f"native {dt}": native_gemm.NativeLinear(w, torch.randn(100, generator=g), weight_dtype=dt)
        for dt in (torch.float32, torch.bfloat16, torch.float16)
    }
    out["native bf16 products"] = native_gemm.NativeLinear(
        w, torch.randn(100, generator=g), weight_dtype=torch.bfloat16, products="bfloat16"
    )
    out["int8act Q8_0"] = quant_int8act.Int8ActLinear(weight("Q8_0", 100, 64, seed=1))
    out["float-activation Q4_1"] = quant_gemm.QuantLinear(weight("Q4_1", 100, 64, seed=2))
    return out


@pytest.mark.parametrize("rows", [1, 17])
def test_the_timed_call_is_the_linears_own_result(rows):
    x = activations(rows, 64, seed=rows)
    for name, lin in linears().items():
        call, y = into_kept_output(lin, x, lin.out_features)
        assert y is not None, name  # timed through its own entry, not lin(x)
        call()
        assert torch.equal(y, lin(x)), name
