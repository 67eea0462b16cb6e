"""The engine's differential mixes (tests/test_batch_invariance.py) on linears that run on GGUF
blocks the small float models do not reach:

- K-quants: a 256-wide model (a K-quant super-block is 256 weights) whose q/k/v are Q4_K, o and
  down Q6_K, gate/up Q5_K and the LM head (and the embedding) Q4_K;
- Q2_K and IQ4_XS: q/k and gate/up Q2_K, v (so q/k/v is two formats), o, down and the LM head
  IQ4_XS (the low-bit files' types);
- 5-bit blocks: the same model with q/k and gate/up Q5_0, v Q8_0 (so q/k/v is one projection of
  two formats, run as row segments), o and down Q5_1, the LM head Q5_0 (Qwen2.5's Q4_K_M files
  keep most of their linears in Q5_0, and half their layers' v in Q8_0);

each on fp32 activations (quant_gemm.c) and on the int8 default (quant_int8act.c; the K-quants
there served from their super-blocks). Every request's
result must equal its solo run, logprobs bit for bit, with chunked prefills, preemptions, prefix
hits and forks."""

from __future__ import annotations

import pytest

from kernels.cpu import quant_int8act
from tests.engine_helpers import make_engine, random_model
from tests.gguf_files import write_gguf
from tests.test_batch_invariance import EXAMPLES, VOCAB, explore

WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4)
# file -> (the type of the tensors not named, {GGUF layer tensor: type}, {linear: format served})
FILES = {
    "k_quants": (
        "Q4_K",
        {
            "attn_q": "Q4_K",
            "attn_k": "Q4_K",
            "attn_v": "Q4_K",
            "attn_output": "Q6_K",
            "ffn_gate": "Q5_K",
            "ffn_up": "Q5_K",
            "ffn_down": "Q6_K",
        },
        {"qkv": "Q4_K", "o": "Q6_K", "gate_up": "Q5_K", "down": "Q6_K", "lm_head": "Q4_K"},
    ),
    "5_bit": (
        "Q5_0",
        {
            "attn_q": "Q5_0",
            "attn_k": "Q5_0",
            "attn_v": "Q8_0",
            "attn_output": "Q5_1",
            "ffn_gate": "Q5_0",
            "ffn_up": "Q5_0",
            "ffn_down": "Q5_1",
        },
        {"qkv": "Q5_0+Q8_0", "o": "Q5_1", "gate_up": "Q5_0", "down": "Q5_1", "lm_head": "Q5_0"},
    ),
    "2_bit": (
        "IQ4_XS",
        {
            "attn_q": "Q2_K",
            "attn_k": "Q2_K",
            "attn_v": "IQ4_XS",
            "attn_output": "IQ4_XS",
            "ffn_gate": "Q2_K",
            "ffn_up": "Q2_K",
            "ffn_down": "IQ4_XS",
        },
        {"qkv": "Q2_K+IQ4_XS", "o": "IQ4_XS", "gate_up": "Q2_K", "down": "IQ4_XS", "lm_head": "IQ4_XS"},
    ),
}
REQUIRED = ("chunked prefills", "preemptions", "prefix-hit tokens", "forks", "general steps")


@pytest.fixture(scope="module", params=sorted(FILES))
def quant_file(request, tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp(request.param)
    d = random_model(
        root / "hf", trained_tokenizer_dir, seed=5, vocab_size=VOCAB, num_key_value_heads=2, **WIDE
    )
    default, layer_types, served = FILES[request.param]
    types = {f"blk.0.{name}.weight": t for name, t in layer_types.items()}
    return write_gguf(d, root / f"wide-{request.param}.gguf", default, types=types), served


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_random_mixes_equal_their_solo_runs_on_quantized_blocks(quant_file, activations):
    path, served = quant_file
    extra = {"quantized_activations": activations}
    model = make_engine(path, **extra).model
    layer = model.layers[0]
    linears = {
        "qkv": layer.qkv_proj,
        "o": layer.o_proj,
        "gate_up": layer.gate_up_proj,
        "down": layer.down_proj,
    }
    linears["lm_head"] = model.lm_head_proj
    assert {name: linear.fmt for name, linear in linears.items()} == served
    for name, linear in linears.items():
        int8 = activations == "int8" and quant_int8act.supports(linear.fmt)
        assert type(linear).__name__ == ("Int8ActLinear" if int8 else "QuantLinear"), name
        if int8 and linear.fmt in quant_int8act.K_FORMATS:  # served from the file's super-blocks
            assert linear.code == quant_int8act.K_FORMATS[linear.fmt], name
    explore(path, max(6, EXAMPLES // 4), extra, REQUIRED)
