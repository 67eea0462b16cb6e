"""Phi-3 (mini, medium, and the 128k / Phi-3.5 long-context models): Llama's layer with the q/k/v
projections fused into one ``qkv_proj`` and the gate/up projections into one ``gate_up_proj`` (gate
rows first), both split into the decoder's slots by the weight map. A partial rotary dimension is
refused. A config's ``sliding_window`` is not served per layer (``max_model_len`` stays inside it,
as Mistral's).

Long-context rotary (``rope_scaling`` / ``rope_parameters`` of type ``longrope``, formerly ``su``):
two frequency sets, ``short_factor`` and ``long_factor`` (one divisor per frequency), and cos/sin
scaled by an attention factor (the config's ``attention_factor``, else HF's
``sqrt(1 + ln(s) / ln(original))`` with s the config's ``factor`` or ``max_position_embeddings /
original_max_position_embeddings``, 1 when s <= 1). As HF's ``generate``, a sequence's length picks
one set for all its tokens: at most ``original_max_position_embeddings`` tokens, the short factors;
more, the long ones at every position (``kernels/reference/rotary.py``: ``rope_table`` stacks both,
``rotary_rows`` picks a token's row). The layer kind declares the switch (``rope_switch``): a
sequence that grows past it is computed again (HF drops its cache there), and the prefix cache keeps
the two tables' blocks apart (docs/models.md, *Long-rope*).

GGUF (llama.cpp's converter): ``attn_qkv`` and ``ffn_up`` are the fused tensors as HF has them
(rows not permuted: Phi-3's rotary is the NeoX layout); a long-rope file's factors are the
``rope_factors_long`` / ``rope_factors_short`` tensors, with the original length and the attention
factor in its metadata (``gguf_long_rope``).
"""

import math

from gguf import quants

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
    rotary = ckpt.arch_field("rope.dimension_count")
    head_dim = ckpt.arch_field("embedding_length") // ckpt.arch_field("attention.head_count")
    return {
        "sliding_window": ckpt.arch_field("attention.sliding_window"),
        "partial_rotary_factor": None if rotary in (None, head_dim) else rotary / head_dim,
        **gguf_long_rope(ckpt, (rotary or head_dim) // 2),
    }


def gguf_long_rope(ckpt, half: int) -> dict:
    """A long-rope file as llama.cpp's converter writes it: the two factor lists as F32 tensors
    ``rope_factors_short`` / ``rope_factors_long`` (rotary dim / 2 each), the original length in
    ``rope.scaling.original_context_length``, the attention factor it computed in
    ``rope.scaling.attn_factor`` (HF's, from context_length / original), the model's context in
    ``context_length``; nothing for a file without the tensors."""
    tensors = {n: ckpt._by_name.get(f"rope_factors_{n}.weight") for n in ("short", "long")}
    if not any(tensors.values()):
        return {}
    where = f"GGUF file {ckpt.path.name}"
    factors = {}
    for name, t in tensors.items():
        if t is None:
            other = "long" if name == "short" else "short"
            raise ValueError(f"{where} has rope_factors_{other} but no rope_factors_{name}")
        values = quants.dequantize(t.data, t.tensor_type).reshape(-1)
        if values.size != half:
            raise ValueError(
                f"{where}: rope_factors_{name} has {values.size} factors; the rotary needs {half}"
            )
        factors[name] = [float(v) for v in values]
    original = ckpt.arch_field("rope.scaling.original_context_length")
    if not original:
        raise ValueError(
            f"{where}: long-rope factors without {ckpt.architecture}.rope.scaling.original_context_length"
        )
    scaling = {"rope_type": "longrope", "short_factor": factors["short"], "long_factor": factors["long"]}
    attention = ckpt.arch_field("rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return {"rope_scaling": scaling, "original_max_position_embeddings": int(original)}


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
        model_type="phi3",
        tiny_config={"sliding_window": None},  # (a window is not served per layer)
    )
)
