"""The engine's differential mixes (tests/test_batch_invariance.py) on linears that run on GGUF
K-quant blocks: a 256-wide model (a K-quant super-block is 256 weights) whose q/k/v are Q4_K, o
and down Q6_K, gate/up Q5_K and the LM head (and the embedding) Q4_K, on fp32 activations
(quant_gemm.c) and on the int8 default (quant_int8act.c). Every request's result must equal its
solo run, logprobs bit for bit, with chunked prefills, preemptions, prefix hits and forks."""

from __future__ import annotations

import pytest

from kernels.cpu import quant_int8act
from tests.engine_helpers import make_engine, random_model
from tests.gguf_files import write_gguf
from tests.test_batch_invariance import EXAMPLES, VOCAB, explore

WIDE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4)
LAYER_TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q4_K",
    "attn_output": "Q6_K",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q5_K",
    "ffn_down": "Q6_K",
}
REQUIRED = ("chunked prefills", "preemptions", "prefix-hit tokens", "forks", "general steps")


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory, trained_tokenizer_dir):
    root = tmp_path_factory.mktemp("k_quants")
    d = random_model(
        root / "hf", trained_tokenizer_dir, seed=5, vocab_size=VOCAB, num_key_value_heads=2, **WIDE
    )
    types = {f"blk.0.{name}.weight": t for name, t in LAYER_TYPES.items()}
    return write_gguf(d, root / "wide-k-quants.gguf", "Q4_K", types=types)


@pytest.mark.parametrize("activations", ["none", "int8"])
def test_random_mixes_equal_their_solo_runs_on_k_quant_blocks(k_quant_file, activations):
    extra = {"quantized_activations": activations}
    model = make_engine(k_quant_file, **extra).model
    layer = model.layers[0]
    linears = {
        "qkv": layer.qkv_proj,
        "o": layer.o_proj,
        "gate_up": layer.gate_up_proj,
        "down": layer.down_proj,
    }
    linears["lm_head"] = model.lm_head_proj
    fmts = {name: linear.fmt for name, linear in linears.items()}
    assert fmts == {"qkv": "Q4_K", "o": "Q6_K", "gate_up": "Q5_K", "down": "Q6_K", "lm_head": "Q4_K"}
    for name, linear in linears.items():
        int8 = activations == "int8" and quant_int8act.supports(linear.fmt)
        assert type(linear).__name__ == ("Int8ActLinear" if int8 else "QuantLinear"), name
    explore(k_quant_file, max(6, EXAMPLES // 4), extra, REQUIRED)
