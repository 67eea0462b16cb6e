"""Gemma (the first): Llama's layer with Gemma's parts -- a GELU-tanh gated MLP (``hidden_act``
``gelu_pytorch_tanh``; the legacy ``gelu`` of the released configs means it too, as transformers
reads it), ``(1 + w)`` RMSNorms (before the attention and before the MLP only: no sandwich norms),
the embedding scaled by ``sqrt(hidden)``, a tied head by default, the attention scaled by
``head_dim ** -0.5``; every layer full attention with one rotary table; no soft-capping, no window.

GGUF (llama.cpp's converter, ``gemma``): Llama's tensor names, q/k rows not permuted, the norms
stored as ``1 + w``, no ``output.weight`` (the head is the embedding). transformers' GGUF reader
has no ``gemma`` config; its tokenizer converts through the generic backend.
"""

from engine_svc.models.arch import Architecture, LayerAttention, full_attention_layers, register

TANH_GELUS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")  # (transformers maps "gelu" to the first)


def layers(cfg: dict) -> tuple[LayerAttention, ...]:
    act = cfg.get("hidden_act") or TANH_GELUS[0]
    if act not in TANH_GELUS:
        raise ValueError(f"GemmaForCausalLM: hidden_act {act!r} is not supported (GELU-tanh is)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("GemmaForCausalLM: use_bidirectional_attention is not supported (causal only)")
    return full_attention_layers(cfg)


GEMMA = register(
    Architecture(
        name="GemmaForCausalLM",
        gguf="gemma",
        layers=layers,
        activation="gelu_tanh",
        norm_offset=1.0,
        scale_embedding=True,
        features=frozenset(),  # LoRA, speculation and tensor parallelism not tested on it yet
        model_type="gemma",
        tiny_config={"head_dim": None},  # (Gemma's default head_dim is 256)
    )
)
