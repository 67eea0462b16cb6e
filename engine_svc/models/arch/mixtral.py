"""Mixtral: Llama's layer with routed experts on every layer (``num_local_experts``, of
``intermediate_size``; ``num_experts_per_tok`` per token). The router (``block_sparse_moe.gate``)
scores the experts, a softmax in fp32 over all of them, the top k, divided by their sum (the same
weights as a softmax over the top-k logits, up to rounding; transformers 5 computes it so). Each
expert is a SiLU-gated MLP (HF: ``block_sparse_moe.experts.{e}.w1`` gate, ``w3`` up, ``w2`` down
as saved; ``mlp.experts.gate_up_proj``/``down_proj`` stacked as transformers 5 holds them). A
config's ``sliding_window`` is served on every layer.

GGUF: llama.cpp writes Mixtral as ``llama`` with ``llama.expert_count`` (so a llama file with
experts is this declaration), q/k rows permuted as Llama's, the experts stacked in
``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps`` and the router in ``ffn_gate_inp``. Files of
llama.cpp's first Mixtral layout (one tensor per expert, ``ffn_gate.{e}``) are refused.
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
from engine_svc.models.arch.qwen3_moe import STACKED_GGUF

_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def layers(cfg: dict) -> tuple[LayerAttention, ...]:
    theta, scaling = rope_of(cfg)
    return (LayerAttention(cfg.get("sliding_window"), theta, scaling),) * cfg["num_hidden_layers"]


def experts(cfg: dict) -> tuple[Experts | None, ...]:
    kind = Experts(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], True)
    return (kind,) * cfg["num_hidden_layers"]


def gguf_config(ckpt) -> dict:
    return {
        "num_local_experts": ckpt.arch_field("expert_count"),
        "num_experts_per_tok": ckpt.arch_field("expert_used_count"),
        "sliding_window": ckpt.arch_field("attention.sliding_window"),
    }


MIXTRAL = register(
    Architecture(
        name="MixtralForCausalLM",
        gguf="llama",
        gguf_experts=True,
        gguf_permuted_qk=True,
        layers=layers,
        window_served=True,
        layer_weights={
            **{k: v for k, v in LLAMA_LAYER_WEIGHTS.items() if k not in _DENSE_MLP},
            "block_sparse_moe.gate.weight": "router.weight",
            "mlp.gate.weight": "router.weight",  # (transformers 5's spelling)
        },
        gguf_names={
            **{k: v for k, v in LLAMA_GGUF_NAMES.items() if v not in _DENSE_MLP},
            "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
            **STACKED_GGUF,
        },
        experts=experts,
        expert_weights={
            "block_sparse_moe.experts.{e}.w1.weight": "experts.gate",
            "block_sparse_moe.experts.{e}.w3.weight": "experts.up",
            "block_sparse_moe.experts.{e}.w2.weight": "experts.down",
            "mlp.experts.gate_up_proj": "experts.gate_up",
            "mlp.experts.gate_proj": "experts.gate",
            "mlp.experts.up_proj": "experts.up",
            "mlp.experts.down_proj": "experts.down",
        },
        gguf_config=gguf_config,
        features=frozenset(),  # LoRA, speculation and tensor (expert) parallelism not built for experts
        model_type="mixtral",
        tiny_config={"sliding_window": None, "num_local_experts": 6, "num_experts_per_tok": 2},
    )
)
