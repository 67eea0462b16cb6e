"""Gemma 2: sliding-window and global layers alternating (``layer_types``; without it, even layers
local), one rotary table for both kinds, the attention scores soft-capped
(``attn_logit_softcapping``: ``tanh(s / cap) * cap`` on the scaled scores, before the mask and the
softmax) and the final logits too (``final_logit_softcapping``), a GELU-tanh gated MLP, ``(1 + w)``
RMSNorms before and after the attention and the MLP, the embedding scaled by ``sqrt(hidden)``, a
tied head, and the attention's scale from ``query_pre_attn_scalar``. No q/k norms (Gemma 3's
addition).

GGUF (llama.cpp's converter): Gemma 3's tensor names and its ``1 + w`` norms; the window and both
soft-caps are in the metadata; the layer pattern (every other layer global) and the query scale
are not: llama.cpp scales by ``head_dim`` except for the 46-layer (27B) model, whose
``query_pre_attn_scalar`` is ``hidden / heads``, and so does this reader.
"""

from engine_svc.models.arch import Architecture, LayerAttention, register, rope_of
from engine_svc.models.arch.gemma3 import GEMMA3

PATTERN = 2  # every other layer is global
LAYERS_OF_27B = 46


def layers(cfg: dict) -> tuple[LayerAttention, ...]:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % PATTERN else "full_attention" for i in range(n)
    ]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries; num_hidden_layers is {n}")
    theta, scaling = rope_of(cfg)
    out = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            window = None
        elif kind == "sliding_attention":
            window = cfg.get("sliding_window")
            if not window or window < 1:
                raise ValueError(f"layer {i} is sliding_attention but sliding_window is {window!r}")
        else:
            raise ValueError(
                f"layer_types[{i}] is {kind!r}; Gemma 2 has full_attention and sliding_attention"
            )
        out.append(LayerAttention(window, theta, scaling))
    return tuple(out)


def gguf_config(ckpt) -> dict:
    hidden, heads = ckpt.arch_field("embedding_length"), ckpt.arch_field("attention.head_count")
    head_dim = ckpt.arch_field("attention.key_length") or hidden // heads
    big = ckpt.arch_field("block_count") == LAYERS_OF_27B
    return {
        "sliding_window": ckpt.arch_field("attention.sliding_window"),
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "attn_logit_softcapping": ckpt.arch_field("attn_logit_softcapping"),
        "final_logit_softcapping": ckpt.arch_field("final_logit_softcapping"),
    }


GEMMA2 = register(
    Architecture(
        name="Gemma2ForCausalLM",
        gguf="gemma2",
        layers=layers,
        activation="gelu_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        scale_embedding=True,
        query_scale_key="query_pre_attn_scalar",
        final_softcap_key="final_logit_softcapping",
        attn_softcap_key="attn_logit_softcapping",
        window_served=True,
        layer_weights=GEMMA3.layer_weights,  # Gemma 3's names less its q/k norms (none here)
        gguf_names=GEMMA3.gguf_names,
        gguf_config=gguf_config,
        features=frozenset(),  # LoRA, speculation and tensor parallelism not tested on it yet
        model_type="gemma2",
        # local and global layers alternating, soft-capped attention scores and logits
        tiny_config={"head_dim": None, "sliding_window": 8, "query_pre_attn_scalar": 16},
    )
)
