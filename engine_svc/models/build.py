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

from engine_svc.models import arch as archs


def make_config(arch: str, **overrides):
    """transformers' config of ``arch``'s random tiny model (its declaration's ``build_name``): the
    common shape below, the declaration's ``tiny_config``, then ``overrides``."""
    decl = archs.by_build_name(arch)
    if decl is None:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {archs.build_names()}")
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
        **decl.tiny_config,
    }
    fields.update(overrides)
    if "head_dim" in decl.tiny_config and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return AutoConfig.for_model(decl.model_type, **fields)


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
