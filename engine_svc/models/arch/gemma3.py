"""Gemma 3 (text): five sliding-window layers to one global layer (``layer_types``, or the pattern
of ``sliding_window_pattern``, 6), each kind with its own rotary base (local 10k, global 1M with the
config's rope scaling), q/k RMSNorm, a GELU-tanh gated MLP, ``(1 + w)`` RMSNorms before and after
the attention and the MLP, the embedding scaled by ``sqrt(hidden)``, a tied head, and the
attention's scale from ``query_pre_attn_scalar``.

GGUF (llama.cpp's converter): the norms are stored as ``1 + w`` (the reader subtracts the one, as
transformers' GGUF loader does, and the load adds it back); the local rotary base is not in the
file (llama.cpp's 10,000) nor the layer pattern (every sixth layer global); q/k rows are not
permuted.
"""

from engine_svc.models.arch import (
    LLAMA_GGUF_NAMES,
    LLAMA_LAYER_WEIGHTS,
    Architecture,
    LayerAttention,
    register,
)

LOCAL_ROPE_BASE = 10000.0  # transformers' and llama.cpp's default for the sliding layers
PATTERN = 6  # every sixth layer is global


def layers(cfg: dict) -> tuple[LayerAttention, ...]:
    n = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern") or PATTERN
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries; num_hidden_layers is {n}")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # transformers 4: rope_theta, rope_local_base_freq, rope_scaling (global layers only)
        full = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", LOCAL_ROPE_BASE)}
    out = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            p, window = full, None
        elif kind == "sliding_attention":
            p, window = local, cfg.get("sliding_window")
            if not window or window < 1:
                raise ValueError(f"layer {i} is sliding_attention but sliding_window is {window!r}")
        else:
            raise ValueError(
                f"layer_types[{i}] is {kind!r}; Gemma 3 has full_attention and sliding_attention"
            )
        theta = float(p.get("rope_theta", 1_000_000.0 if window is None else LOCAL_ROPE_BASE))
        scaling = {k: v for k, v in p.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        out.append(LayerAttention(window, theta, scaling))
    return tuple(out)


def gguf_config(ckpt) -> dict:
    head_dim = ckpt.arch_field("attention.key_length")
    cfg = {
        "sliding_window": ckpt.arch_field("attention.sliding_window"),
        "sliding_window_pattern": PATTERN,
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": head_dim,
        "final_logit_softcapping": ckpt.arch_field("final_logit_softcapping"),
    }
    if ckpt.arch_field("rope.scaling.type") == "linear":  # applies to the global layers
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(ckpt.arch_field("rope.scaling.factor"))}
    return cfg


GEMMA3 = register(
    Architecture(
        name="Gemma3ForCausalLM",
        gguf="gemma3",
        layers=layers,
        qk_norm=True,
        activation="gelu_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        scale_embedding=True,
        query_scale_key="query_pre_attn_scalar",
        final_softcap_key="final_logit_softcapping",
        window_served=True,
        layer_weights={
            **LLAMA_LAYER_WEIGHTS,
            "post_attention_layernorm.weight": "attn_out_norm",
            "pre_feedforward_layernorm.weight": "mlp_norm",
            "post_feedforward_layernorm.weight": "mlp_out_norm",
        },
        gguf_names={
            **LLAMA_GGUF_NAMES,
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        gguf_config=gguf_config,
        features=frozenset(),  # LoRA, speculation and tensor parallelism not tested on it yet
        model_type="gemma3_text",
        short_name="gemma3",
        # 5 local layers to 1 global by default; tests name layer_types to mix a few
        tiny_config={"head_dim": None, "sliding_window": 8, "query_pre_attn_scalar": 16},
    )
)
