"""Random-weight LoRA adapters in PEFT's on-disk format (``adapter_config.json`` +
``adapter_model.safetensors``), for benchmarks and the GPU check: no adapter is ever downloaded, and
these need no ``peft``. The tests make theirs with ``peft`` itself (tests/lora_helpers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_svc.lora.geometry import TARGET_MODULES, targets
from engine_svc.models.spec import ModelSpec

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_random_adapter(
    model: str | Path,
    out: str | Path,
    rank: int,
    seed: int,
    modules: tuple[str, ...] = TARGET_MODULES,
    std: float = 0.02,
) -> Path:
    spec = ModelSpec.from_path(model)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, t in targets(spec).items():
            if module not in modules:
                continue
            kind = "self_attn" if module in ATTENTION_MODULES else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, t.in_features, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(t.out_features, rank, generator=gen) * std
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(modules))
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
