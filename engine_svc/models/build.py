"""Build random-weight checkpoints of real architectures, in the HF layout, from a fixed seed.

The built-in default model (``build_default``: what ``make model`` falls back to offline) is one;
tests and benchmarks build theirs here too: no weights are ever downloaded. The result is
an ordinary HF model directory (config.json, generation_config.json, model.safetensors) that both
`transformers` and this engine load.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

ARCH_DEFAULTS: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": None},  # filled below: Qwen3 carries head_dim explicitly
    # Gemma 3 (text): 5 local layers to 1 global by default; tests name layer_types to mix a few
    "gemma3": {"head_dim": None, "sliding_window": 8, "query_pre_attn_scalar": 16},
    # Phi-3: fused qkv and gate/up projections; no window served per layer
    "phi3": {"sliding_window": None},
    # Gemma 2: local and global layers alternating, soft-capped attention scores and logits
    "gemma2": {"head_dim": None, "sliding_window": 8, "query_pre_attn_scalar": 16},
    # routed experts (mixture of experts): 8 of width 32, two a token; layer 1 a dense MLP
    "qwen3_moe": {
        "head_dim": None, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    },
    "mixtral": {"sliding_window": None, "num_local_experts": 6, "num_experts_per_tok": 2},
    # SmolLM3: Llama's layer, no rotary on every fourth layer (NoPE); tied embeddings by default
    "smollm3": {"pad_token_id": None},
}  # fmt: skip
# transformers' model_type where it differs from the name here
_MODEL_TYPES = {"gemma3": "gemma3_text"}


def make_config(arch: str, **overrides):
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(ARCH_DEFAULTS)}")
    fields = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": 1,
        "pad_token_id": None,
        **ARCH_DEFAULTS[arch],
    }
    fields.update(overrides)
    if arch in ("qwen3", "qwen3_moe", "gemma3", "gemma2") and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if arch == "qwen2":
        fields.setdefault("use_sliding_window", False)
    return AutoConfig.for_model(_MODEL_TYPES.get(arch, arch), **fields)


def build_random_model(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    generation_eos: int | list[int] | None = None,
    **overrides,
) -> Path:
    """Write a random-weight model of ``arch`` to ``out_dir`` and return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out, safe_serialization=True)
    eos = generation_eos if generation_eos is not None else config.eos_token_id
    GenerationConfig(
        eos_token_id=eos, bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    ).save_pretrained(out)
    return out
