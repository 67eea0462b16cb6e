"""Phi-3 (mini, medium): Llama's layer with the q/k/v projections fused into one ``qkv_proj`` and
the gate/up projections into one ``gate_up_proj`` (gate rows first), both split into the
decoder's slots by the weight map. Its long-context rotary scaling (``rope_scaling`` of type
``longrope``, formerly ``su``) picks one of two frequency tables by the sequence's length in HF,
which a paged cache of already-rotated keys cannot follow: refused, as is a partial rotary
dimension. A config's ``sliding_window`` is not served per layer (``max_model_len`` stays inside
it, as Mistral's).

GGUF (llama.cpp's converter): ``attn_qkv`` and ``ffn_up`` are the fused tensors as HF has them
(rows not permuted: Phi-3's rotary is the NeoX layout); a long-rope file carries
``rope_factors_long``/``rope_factors_short`` and is refused for the same reason.
"""

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
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in LONG_ROPE:
        raise ValueError(
            f"Phi3ForCausalLM: rope_scaling of type {kind!r} (Phi-3's long-context rotary, a frequency "
            "table chosen by the sequence's length) is not supported"
        )
    params = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor {partial} is not supported (1.0 is)")
    return (LayerAttention(None, theta, scaling),) * cfg["num_hidden_layers"]


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
