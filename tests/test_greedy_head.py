"""Greedy tokens without the whole logits (kernels/cpu/greedy_head.py): the LM head's int8-activation
GEMM with the argmax inside it (each work item's group of panels, merged), or a vocabulary slice at
a time with each slice's argmax merged, gives ``argmax_rows`` of the whole head's output on every
instruction set, for any group or slice width, with ties and NaNs across their boundaries; and the
engine takes that path in a step whose sample rows are all greedy (its logits are never made) and
nowhere else, with the tokens of the logits path."""

from __future__ import annotations

import os

import pytest
import torch

from engine_svc import SamplingParams
from engine_svc.model_runner import ModelForward
from engine_svc.sampler import argmax_rows
from kernels.cpu import greedy_head, native_build, native_gemm, quant_gemm, quant_int8act
from kernels.cpu.greedy_head import ChunkedArgmax
from tests.engine_helpers import make_engine, random_model
from tests.gguf_files import write_gguf
from tests.test_quant_int8act import activations, weight

ISAS = [isa for isa in native_build.supported_isas() if quant_int8act.library(isa) is not None]
NATIVE_ISAS = [isa for isa in native_build.supported_isas() if native_gemm.library(isa) is not None]


def native_heads(isa: str, n: int, k: int, seed: int, bias: torch.Tensor | None = None) -> dict:
    """A native head per weight kind on ``isa``: fp32, fp16, bf16 on the FMA panels, and bf16 on
    the AMX-BF16 tiles where they are granted here."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    heads = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        saved = native_gemm.bf16_amx(isa)
        native_gemm.bf16_amx(isa, on=False)
        try:
            heads[str(dtype)] = native_gemm.NativeLinear(w, bias, isa=isa, weight_dtype=dtype)
        finally:
            native_gemm.bf16_amx(isa, on=saved)
    if native_gemm.bf16_amx(isa):
        heads["bf16-amx"] = native_gemm.NativeLinear(w, bias, isa=isa, weight_dtype=torch.bfloat16)
        assert heads["bf16-amx"].amx
    assert not heads[str(torch.bfloat16)].amx
    return heads


@pytest.fixture
def narrow(monkeypatch):
    """Slices of one panel (32 columns) upwards, and fused items of one panel: many slice and item
    boundaries at small vocabularies."""
    monkeypatch.setattr(greedy_head, "SLICE_FLOATS", 32)
    monkeypatch.setattr(greedy_head, "MIN_SLICE", 1)
    monkeypatch.setattr(greedy_head, "GROUP_PANELS", 1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "slices"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q8_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 5, 64, 600])
def test_sliced_argmax_is_the_whole_heads(isa, fmt, m, fused, narrow, monkeypatch):
    """600 rows: several row chunks of the fused call's items (256 a chunk, 512 on the tiles)."""
    monkeypatch.setenv("LLMSERVE_GREEDY_HEAD_FUSED", "1" if fused else "0")
    k, n = 256, 1000 + 7  # not a whole number of panels
    qw = weight(fmt, n, k, seed=m + 3)
    linear = quant_int8act.Int8ActLinear(qw, isa=isa)
    sliced = ChunkedArgmax.of(linear)
    assert sliced is not None and (sliced.fused is not None) == fused
    assert sliced.width(m) < n
    x = activations(m, k, seed=m)
    want = argmax_rows(linear(x)).tolist()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert sliced(x).tolist() == want
    finally:
        torch.set_num_threads(threads)
    if fused:  # the default groups too (one item over the whole vocabulary here)
        monkeypatch.setattr(greedy_head, "GROUP_PANELS", 16)
        assert sliced(x).tolist() == want


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("m", [1, 5, 17, 64])
def test_sliced_argmax_of_a_native_head_is_the_whole_heads(isa, m, narrow):
    """fp32 / fp16 / bf16 heads on the FMA panels and bf16 on the AMX tiles (a bf16 checkpoint's
    untied head): every slice's columns are the whole call's bits, and the merged argmax its."""
    k, n = 100, 1000 + 7  # not a whole number of panels, nor k of the tiles' 32
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    for kind, linear in native_heads(isa, n, k, seed=m + 1).items():
        sliced = ChunkedArgmax.of(linear)
        assert sliced is not None, kind
        width = sliced.width(m)
        assert width < n and width % linear.panel == 0, kind
        whole = linear(x)
        buf = torch.empty(m * width)
        for c0 in range(0, n, width):
            w = min(width, n - c0)
            linear.columns(x, c0, w, buf)
            assert torch.equal(buf[: m * w].view(m, w), whole[:, c0 : c0 + w]), (kind, c0)
        assert sliced(x).tolist() == argmax_rows(whole).tolist(), kind


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_ties_and_nans_across_slices_of_a_native_head(isa, narrow):
    k, n = 64, 256
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
    for r, (values, expected) in enumerate(_TIES):
        bias = torch.zeros(n)
        for col, v in values.items():
            bias[col] = v
        for kind, linear in native_heads(isa, n, k, seed=1, bias=bias).items():
            sliced = ChunkedArgmax.of(linear)
            assert sliced.width(1) < n
            assert argmax_rows(linear(x)).tolist() == [expected], (r, kind)
            assert sliced(x).tolist() == [expected], (r, kind)


@pytest.mark.parametrize("isa", ISAS)
def test_ties_and_nans_across_slices(isa):
    ties_and_nans_across_slices(isa)


def ties_and_nans_across_slices(isa: str) -> None:
    """Through the bias: equal huge values in two slices (the first wins), a NaN after a larger
    value in a later slice (the NaN wins), two NaNs (the first), +inf then NaN, all -inf (index 0);
    the fused head's items of one panel (its merge of the items) and the slices (theirs).
    (Also tests/test_mutants.py's check of the merge.)"""
    saved = greedy_head.SLICE_FLOATS, greedy_head.MIN_SLICE, greedy_head.GROUP_PANELS
    env = os.environ.get("LLMSERVE_GREEDY_HEAD_FUSED")
    greedy_head.SLICE_FLOATS, greedy_head.MIN_SLICE = 32, 1  # one panel a slice
    greedy_head.GROUP_PANELS = 1  # one panel a fused item
    try:
        for fused in ("1", "0"):
            os.environ["LLMSERVE_GREEDY_HEAD_FUSED"] = fused
            _ties_and_nans(isa, fused == "1")
    finally:
        greedy_head.SLICE_FLOATS, greedy_head.MIN_SLICE, greedy_head.GROUP_PANELS = saved
        if env is None:
            os.environ.pop("LLMSERVE_GREEDY_HEAD_FUSED", None)
        else:
            os.environ["LLMSERVE_GREEDY_HEAD_FUSED"] = env


# (bias values, the argmax) over 256 columns: slices of 32 (int8 heads, AMX bf16) or more panels
_TIES = [
    ({40: 1e30, 200: 1e30}, 40),  # a tie across slices
    ({10: 1e30, 150: float("nan")}, 150),  # a NaN in a later slice
    ({70: float("nan"), 230: float("nan")}, 70),  # two NaNs: the first
    ({5: float("inf"), 100: float("nan")}, 100),  # +inf then NaN
    ({i: float("-inf") for i in range(256)}, 0),  # nothing but -inf
    ({33: 1e30, 34: 1e30, 255: 1e30}, 33),  # a tie inside a slice and one at the end
]


def _ties_and_nans(isa: str, fused: bool) -> None:
    k, n = 64, 256
    qw = weight("Q8_0", n, k, seed=1)
    x = activations(6, k, seed=2)
    cases = {r: values for r, (values, _) in enumerate(_TIES)}
    expected = {r: e for r, (_, e) in enumerate(_TIES)}
    for r, values in cases.items():
        bias = torch.zeros(n)
        for col, v in values.items():
            bias[col] = v
        linear = quant_int8act.Int8ActLinear(qw, bias, isa=isa)
        sliced = ChunkedArgmax.of(linear)
        assert sliced.width(1) == 32  # one panel a slice
        assert (sliced.fused is not None) == fused
        whole = argmax_rows(linear(x[r : r + 1]))
        got = sliced(x[r : r + 1])
        assert whole.tolist() == [expected[r]], r
        assert got.tolist() == [expected[r]], r


def test_heads_it_does_not_slice():
    qw = weight("Q5_0+Q8_0", 64, 64, seed=3)  # row segments in two formats
    assert ChunkedArgmax.of(quant_int8act.Int8ActLinear(qw)) is None
    assert ChunkedArgmax.of(quant_gemm.QuantLinear(weight("Q8_0", 64, 64, seed=3))) is None


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("greedy_head")
    return random_model(root / "hf", trained_tokenizer_dir, seed=7, vocab_size=1024, num_key_value_heads=2)


@pytest.fixture(scope="module")
def q8_file(hf_dir):
    return write_gguf(hf_dir, hf_dir.parent / "q8.gguf", "Q8_0")


# (model fixture, engine options, the head's class): the Q8_0 head on int8 activations; the HF
# checkpoint's head in bf16 on the native GEMM (the AMX tiles where granted: a bf16 directory's)
ENGINES = {
    "q8": ("q8_file", dict(quantized_activations="int8"), "Int8ActLinear"),
    "bf16": ("hf_dir", dict(dtype="bfloat16", linear_backend="native"), "NativeLinear"),
}


def _requests():
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in (5, 40, 17, 90)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with_lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    return prompts, [greedy, greedy, with_lp, seeded]


def _run(engine, prompts, params, only=None):
    order = range(len(prompts)) if only is None else only
    for i in order:
        engine.add_request(str(i), prompts[i], params[i])
    out = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return out


@pytest.mark.parametrize("which", list(ENGINES))
def test_the_engine_takes_it_for_all_greedy_steps_only(which, request, narrow, monkeypatch):
    """Greedy requests alone: no step makes logits, and the tokens are the logits path's (the same
    engine with the path off). Beside a request with logprobs or a seeded one, the steps make
    their logits as before."""
    fixture, options, head_class = ENGINES[which]
    path = request.getfixturevalue(fixture)
    prompts, params = _requests()
    results = {}
    for on in (True, False):
        with monkeypatch.context() as patch:
            if not on:
                patch.setattr(ModelForward, "gives_greedy", property(lambda self: False))
            engine = make_engine(path, **options)
            model = engine.runner.forward.model
            assert type(model.lm_head_proj).__name__ == head_class
            made = []
            logits = model.compute_logits

            def spy(hidden, logits=logits, made=made):
                made.append(len(hidden))
                return logits(hidden)

            model.compute_logits = spy
            greedy_only = _run(engine, prompts, params, only=[0, 1])
            assert bool(made) != on, "an all-greedy step made logits" if on else "no logits made"
            made.clear()
            mixed = _run(engine, prompts, params)
            assert made
        results[on] = (greedy_only, mixed)
    assert results[True] == results[False]
