"""Qwen3-MoE: Qwen3's layer (per-head q/k RMSNorm, no qkv bias) with routed experts in place of the
dense MLP on every layer that ``decoder_sparse_step`` picks (layer i when ``(i + 1) % step == 0``)
and ``mlp_only_layers`` does not list; the others keep a dense MLP of ``intermediate_size``. The
router (``mlp.gate``) scores all ``num_experts`` experts, a softmax in fp32 over all of them, the
``num_experts_per_tok`` largest, divided by their sum when ``norm_topk_prob``; each expert is a
SiLU-gated MLP of ``moe_intermediate_size`` (HF: ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
as saved, ``mlp.experts.gate_up_proj``/``down_proj`` stacked as transformers 5 holds them). A
config's sliding window (``use_sliding_window``) is served on every layer. Qwen2-MoE's shared
expert (``shared_expert_intermediate_size``) is not built and refuses the config.

GGUF (llama.cpp's ``qwen3moe``): the experts stacked in ``ffn_gate_exps``/``ffn_up_exps``/
``ffn_down_exps`` (``[E, rows, cols]``), the router in ``ffn_gate_inp``; llama.cpp renormalises
the top-k weights (as ``norm_topk_prob``: true) and has no dense layers; a layer without a router
here is read as a dense one (``mlp_only_layers``).
"""

from engine_svc.models.arch import (
    LLAMA_GGUF_NAMES,
    LLAMA_LAYER_WEIGHTS,
    Architecture,
    Experts,
    LayerAttention,
    register,
    rope_of,
)

# The stacked GGUF experts' names on the HF side (transformers 5 fuses gate and up, GGUF does not)
STACKED_GGUF = {
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}


def window_of(cfg: dict) -> int | None:
    return cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None


def layers(cfg: dict) -> tuple[LayerAttention, ...]:
    theta, scaling = rope_of(cfg)
    return (LayerAttention(window_of(cfg), theta, scaling),) * cfg["num_hidden_layers"]


def experts(cfg: dict) -> tuple[Experts | None, ...]:
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(
            f"shared_expert_intermediate_size {cfg['shared_expert_intermediate_size']}: a shared expert "
            "(Qwen2-MoE's) is not supported"
        )
    count = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # (transformers 5: the latter)
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    top_k, width = cfg.get("num_experts_per_tok", 1), cfg.get("moe_intermediate_size") or 0
    kind = Experts(count, top_k, width, bool(cfg.get("norm_topk_prob"))) if count else None
    return tuple(
        kind if kind and i not in dense and (i + 1) % step == 0 else None
        for i in range(cfg["num_hidden_layers"])
    )


def gguf_config(ckpt) -> dict:
    n = ckpt.arch_field("block_count")
    return {
        "num_experts": ckpt.arch_field("expert_count"),
        "num_experts_per_tok": ckpt.arch_field("expert_used_count"),
        "moe_intermediate_size": ckpt.arch_field("expert_feed_forward_length"),
        "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalises
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in ckpt._by_name],
        "sliding_window": ckpt.arch_field("attention.sliding_window"),
    }


QWEN3_MOE = register(
    Architecture(
        name="Qwen3MoeForCausalLM",
        gguf="qwen3moe",
        layers=layers,
        qk_norm=True,
        window_served=True,
        layer_weights={**LLAMA_LAYER_WEIGHTS, "mlp.gate.weight": "router.weight"},
        gguf_names={**LLAMA_GGUF_NAMES, "ffn_gate_inp.weight": "mlp.gate.weight", **STACKED_GGUF},
        experts=experts,
        expert_weights={
            "mlp.experts.{e}.gate_proj.weight": "experts.gate",
            "mlp.experts.{e}.up_proj.weight": "experts.up",
            "mlp.experts.{e}.down_proj.weight": "experts.down",
            "mlp.experts.gate_up_proj": "experts.gate_up",
            "mlp.experts.gate_proj": "experts.gate",
            "mlp.experts.up_proj": "experts.up",
            "mlp.experts.down_proj": "experts.down",
        },
        gguf_config=gguf_config,
        features=frozenset(),  # LoRA, speculation and tensor (expert) parallelism not built for experts
        model_type="qwen3_moe",
        # 8 experts of width 32, two a token; layer 1 a dense MLP
        tiny_config={
            "head_dim": None,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },  # fmt: skip
    )
)
