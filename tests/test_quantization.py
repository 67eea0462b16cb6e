"""The quantization option end to end: which path a load takes (GGUF blocks by default, an explicit
float dtype dequantizes), bad values refused with the field named, and the GGUF-block path's
greedy tokens and logprobs bit-equal to the dequantized fp32 path (the kernel does the same math)
with ``quantized_activations="none"``; the default int8 activations run the int8 kernel on every
format it has, close to the exact path."""

from __future__ import annotations

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.models.quantized_weights import (
    DEFAULT_ACTIVATIONS,
    gguf_blocks,
    resolve_activations,
    resolve_quantization,
)
from engine_svc.sampling_params import SamplingParams
from tests.engine_helpers import make_engine
from tests.gguf_files import write_gguf

CPU = torch.device("cpu")


def test_resolution_of_the_quantization_option():
    assert resolve_quantization(None, is_gguf=True, dtype_given=False, device=CPU, tp=1) == "gguf"
    assert resolve_quantization(None, is_gguf=True, dtype_given=True, device=CPU, tp=1) == "none"
    assert resolve_quantization(None, is_gguf=True, dtype_given=False, device=CPU, tp=2) == "none"
    assert resolve_quantization(None, is_gguf=False, dtype_given=False, device=CPU, tp=1) == "none"
    assert resolve_quantization("int4", is_gguf=False, dtype_given=False, device=CPU, tp=1) == "int4"
    with pytest.raises(ValueError, match="needs a GGUF model file"):
        resolve_quantization("gguf", is_gguf=False, dtype_given=False, device=CPU, tp=1)
    with pytest.raises(ValueError, match="tensor_parallel_size is 2"):
        resolve_quantization("int8", is_gguf=False, dtype_given=False, device=CPU, tp=2)
    with pytest.raises(ValueError, match="device is cuda"):
        resolve_quantization("int8", is_gguf=False, dtype_given=False, device=torch.device("cuda"), tp=1)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"quantization": "int3"}, "quantization must be one of"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "dtype must be unset or float32"),
        ({"quantized_activations": "int4"}, "quantized_activations must be"),
    ],
)
def test_bad_quantization_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="x", **kw).validate()


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q4_0"])
def test_gguf_blocks_equal_the_dequantized_fp32_path_bit_for_bit(tiny_llama, tmp_path, gguf_type):
    path = write_gguf(tiny_llama, tmp_path / f"tiny-{gguf_type}.gguf", gguf_type)
    blocks = make_engine(path, quantized_activations="none")  # fp32 activations: the exact path
    floats = make_engine(path, quantization="none")
    assert {type(layer.gate_up_proj).__name__ for layer in blocks.model.layers} == {"QuantLinear"}
    assert type(blocks.model.lm_head_proj).__name__ == "QuantLinear"
    assert {type(layer.gate_up_proj).__name__ for layer in floats.model.layers} != {"QuantLinear"}
    assert blocks.model.layers[0].gate_up_proj.fmt == gguf_type
    x = torch.randn(5, blocks.spec.hidden_size)
    for a, b in zip(blocks.model.layers, floats.model.layers, strict=True):
        for name in ("qkv_proj", "o_proj", "down_proj"):
            inp = torch.randn(3, getattr(a, name).in_features)
            assert torch.equal(getattr(a, name)(inp), getattr(b, name)(inp)), name
    assert torch.equal(blocks.model.compute_logits(x), floats.model.compute_logits(x))
    dtype_given = make_engine(path, dtype="float32")
    assert {type(layer.qkv_proj).__name__ for layer in dtype_given.model.layers} != {"QuantLinear"}


def test_int8_and_int4_quantize_an_hf_checkpoint_at_load(tiny_llama):
    base = make_engine(tiny_llama)
    x = torch.randn(4, base.spec.hidden_size)
    ref = base.model.compute_logits(x)
    errors = {}
    for q, fmt in (("int8", "Q8_0"), ("int4", "Q4_1")):
        e = make_engine(tiny_llama, quantization=q)
        assert e.model.layers[0].qkv_proj.fmt == fmt and e.model.lm_head_proj.fmt == fmt
        got = e.model.compute_logits(x)
        errors[q] = (got - ref).abs().mean().item() / ref.abs().mean().item()
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        e.add_request("a", [5, 6, 7, 8], params)
        steps = 0
        while e.has_unfinished_requests() and steps < 50:
            e.step()
            steps += 1
        assert not e.has_unfinished_requests()
    assert 0 < errors["int8"] < errors["int4"] < 0.5, errors


def test_resolution_of_the_activations_option():
    assert resolve_activations(None, "gguf", CPU) == DEFAULT_ACTIVATIONS == "int8"
    assert resolve_activations("auto", "int4", CPU) == "int8"
    assert resolve_activations("none", "gguf", CPU) == "none"
    assert resolve_activations("int8", "none", CPU) == "none"  # nothing quantized: nothing to do
    with pytest.raises(ValueError, match="device is cuda"):
        resolve_activations("int8", "gguf", torch.device("cuda"))
    assert resolve_activations(None, "gguf", torch.device("cuda")) == "none"
    with pytest.raises(ValueError, match="quantized_activations must be one of"):
        resolve_activations("fp8", "gguf", CPU)


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0", "Q4_0"])
def test_int8_activations_are_the_default_and_close_to_the_exact_path(tiny_llama, tmp_path, gguf_type):
    from kernels.cpu import quant_int8act

    path = write_gguf(tiny_llama, tmp_path / f"tiny-{gguf_type}.gguf", gguf_type)
    default = make_engine(path)
    exact = make_engine(path, quantized_activations="none")
    explicit = make_engine(path, quantized_activations="int8")
    assert default.runtime.load.quantized_activations == "int8"
    layers = default.model.layers
    assert {type(layer.gate_up_proj).__name__ for layer in layers} == {"Int8ActLinear"}
    assert type(default.model.lm_head_proj).__name__ == "Int8ActLinear"
    blocks, _ = gguf_blocks(default.model, path)  # the file's, read again: the engine freed its own
    for i, (a, b, c) in enumerate(zip(layers, exact.model.layers, explicit.model.layers, strict=True)):
        inp = torch.randn(3, a.qkv_proj.in_features)
        got = a.qkv_proj(inp)
        assert torch.equal(got, c.qkv_proj(inp))
        # the weights are the file's: the int8 kernel's own math on them (its reference), and near
        # the fp32-activation result within the activations' 8-bit rounding
        assert torch.equal(
            got, torch.from_numpy(quant_int8act.reference(inp, blocks[f"layers.{i}.qkv_weight"], a.qkv_bias))
        )
        want = b.qkv_proj(inp)
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    x = torch.randn(5, default.spec.hidden_size)
    ref = exact.model.compute_logits(x)
    err = (default.model.compute_logits(x) - ref).abs().mean() / ref.abs().mean()
    assert 0 < err < 0.05, err
