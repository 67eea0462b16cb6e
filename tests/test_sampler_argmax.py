"""The sampler's argmax (numpy's on the CPU, ``engine_svc.sampler.argmax_rows``) picks what
``torch.argmax`` picks and what a plain reading of "the first maximum, a NaN above everything"
picks: ties, NaNs, infinities, rows of -inf, strided rows, no rows."""

from __future__ import annotations

import math

import pytest
import torch

from engine_svc.sampler import argmax_rows


def _first_maximum(row: list[float]) -> int:
    """The index of the first NaN if any, else of the first largest value."""
    for i, v in enumerate(row):
        if math.isnan(v):
            return i
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (12, 257), generator=g).float()  # many ties
    x[1, 5], x[1, 200] = float("nan"), float("nan")
    x[2] = float("-inf")
    x[3, 7], x[3, 9] = float("inf"), float("inf")
    x[4, 3], x[4, 100] = float("inf"), float("nan")
    x[5] = -0.0
    x[5, 10] = 0.0
    x[6] = torch.randn(257, generator=g)
    return x


def test_the_first_maximum_as_torch_and_a_plain_reader_pick():
    x = _rows()
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert got.tolist() == [_first_maximum(r) for r in x.tolist()]
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("view", ["strided", "transposed", "empty", "bf16"])
def test_other_layouts_and_dtypes(view):
    x = _rows()
    x = {
        "strided": x[:, ::2],
        "transposed": x.t().contiguous().t(),
        "empty": x[:0],
        "bf16": x.bfloat16(),
    }[view]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x).tolist() == [_first_maximum(r) for r in x.float().tolist()]
