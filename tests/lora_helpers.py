"""PEFT adapters for the LoRA tests, made the way users make them (``get_peft_model`` +
``save_pretrained``), with random non-zero A and B (PEFT starts B at zero, which would test nothing)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    r: int,
    targets: list[str],
    alpha: float = 16.0,
    rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
) -> Path:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_model(model_dir: Path, adapter_dir: Path, merged: bool = False):
    """The HF model with the adapter applied by PEFT (or merged into the weights)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    return model.merge_and_unload().eval() if merged else model
