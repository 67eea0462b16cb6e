"""The hyper-parameter reader on both config layouts transformers writes: v4's top-level
``rope_theta`` / ``rope_scaling`` and v5's ``rope_parameters``."""

from __future__ import annotations

import pytest

from engine_svc.models.spec import ModelSpec

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_v4_layout():
    cfg = dict(BASE, rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", **LLAMA3))
    spec = ModelSpec.from_dict(cfg)
    assert spec.rope_theta == 500000.0 and spec.rope_scaling["rope_type"] == "llama3"


def test_v5_layout():
    cfg = dict(BASE, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3))
    spec = ModelSpec.from_dict(cfg)
    assert spec.rope_theta == 500000.0 and spec.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize(
    "cfg",
    [
        dict(BASE),
        dict(BASE, rope_theta=10000.0),
        dict(BASE, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    ],
)
def test_plain_rope_either_way(cfg):
    spec = ModelSpec.from_dict(cfg)
    assert spec.rope_theta == 10000.0 and spec.rope_scaling is None


def test_both_layouts_give_the_same_spec():
    v4 = ModelSpec.from_dict(dict(BASE, rope_theta=1e6, rope_scaling=dict(type="linear", factor=2.0)))
    v5 = ModelSpec.from_dict(dict(BASE, rope_parameters=dict(rope_type="linear", rope_theta=1e6, factor=2.0)))
    assert v4.rope_theta == v5.rope_theta == 1e6
    assert v4.rope_scaling["factor"] == v5.rope_scaling["factor"] == 2.0
