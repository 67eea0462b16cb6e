"""Phi-3 (mini, medium, and the 128k / Phi-3.5 long-context models): Llama's layer with the q/k/v
projections fused into one ``qkv_proj`` and the gate/up projections into one ``gate_up_proj`` (gate
rows first), both split into the decoder's slots by the weight map. A partial rotary dimension is
refused. A config's ``sliding_window`` is not served per layer (``max_model_len`` stays inside it,
as Mistral's).

Long-context rotary (``rope_scaling`` / ``rope_parameters`` of type ``longrope``, formerly ``su``):
two frequency sets, ``short_factor`` and ``long_factor`` (one divisor per frequency), and cos/sin
scaled by an attention factor (the config's ``attention_factor``, else HF's
``sqrt(1 + ln(s) / ln(original))`` with s the config's ``factor`` or ``max_position_embeddings /
original_max_position_embeddings``, 1 when s <= 1). HF picks one set for a whole forward by the
length the sequence reaches in it; here the table is one per position: a position below
``original_max_position_embeddings`` is rotated by the short factors, one at or past it by the long
factors (``kernels/reference/rotary.py``: ``rope_table``). That is HF's ``generate`` exactly while
the prompt fits in the original length (its decode steps past it switch to the long factors, as
here); a longer prompt HF rotates whole with the long factors, its positions below the original
length too, which a token's cached key computed before the sequence grew cannot follow: here those
positions keep the short factors, so a token's rotation depends on its position alone, the same in
any chunk, batch or recompute, and a cached prefix block is valid for every sequence that holds it.

GGUF (llama.cpp's converter): ``attn_qkv`` and ``ffn_up`` are the fused tensors as HF has them
(rows not permuted: Phi-3's rotary is the NeoX layout); a long-rope file (``rope_factors_long`` /
``rope_factors_short``) is refused.
"""

import math

from engine_svc.models.arch import (
    LLAMA_GGUF_NAMES,
    LLAMA_LAYER_WEIGHTS,
    Architecture,
    LayerAttention,
    register,
    rope_of,
)

FUSED = {
    "self_attn.qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "mlp.gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight"),
}
LONG_ROPE = ("longrope", "su")


def layers(cfg: dict) -> tuple[LayerAttention, ...]:
    theta, scaling = rope_of(cfg)
    params = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor {partial} is not supported (1.0 is)")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in LONG_ROPE:
        scaling = long_rope(cfg, scaling)
    return (LayerAttention(None, theta, scaling),) * cfg["num_hidden_layers"]


def long_rope(cfg: dict, scaling: dict) -> dict:
    """The long-rope table's declaration (``kernels.reference.rotary.rope_table``): both factor
    lists, the original length, and the attention factor as HF computes it."""
    heads = cfg["num_attention_heads"]
    half = (cfg.get("head_dim") or cfg["hidden_size"] // heads) // 2
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ValueError("Phi3ForCausalLM: longrope needs original_max_position_embeddings")
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if not isinstance(factors, list | tuple) or len(factors) != half:
            raise ValueError(
                f"Phi3ForCausalLM: rope_scaling {name} must list {half} factors (head_dim / 2), "
                f"got {factors!r}"
            )
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling.get("factor") or cfg["max_position_embeddings"] / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": tuple(float(f) for f in scaling["short_factor"]),
        "long_factor": tuple(float(f) for f in scaling["long_factor"]),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention),
    }


def gguf_config(ckpt) -> dict:
    if any(name.startswith("rope_factors_") for name in ckpt._by_name):
        raise ValueError(
            f"GGUF file {ckpt.path.name}: rope_factors_long/short (Phi-3's long-context rope_scaling) "
            "is not supported"
        )
    rotary = ckpt.arch_field("rope.dimension_count")
    head_dim = ckpt.arch_field("embedding_length") // ckpt.arch_field("attention.head_count")
    return {
        "sliding_window": ckpt.arch_field("attention.sliding_window"),
        "partial_rotary_factor": None if rotary in (None, head_dim) else rotary / head_dim,
    }


_FUSED_HF = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}
_FUSED_HF |= {"mlp.gate_proj.weight", "mlp.up_proj.weight"}

PHI3 = register(
    Architecture(
        name="Phi3ForCausalLM",
        gguf="phi3",
        layers=layers,
        layer_weights={k: v for k, v in LLAMA_LAYER_WEIGHTS.items() if k not in _FUSED_HF},
        fused_weights=FUSED,
        gguf_names={
            **{k: v for k, v in LLAMA_GGUF_NAMES.items() if v not in _FUSED_HF},
            "attn_qkv.weight": "self_attn.qkv_proj.weight",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
        },
        gguf_config=gguf_config,
        features=frozenset(),  # LoRA, speculation and tensor parallelism not tested on it yet
    )
)
