"""Build random-weight checkpoints of real architectures, in the HF layout, from a fixed seed.

Tests, benchmarks and the default model use these: no weights are ever downloaded. The result is
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
}


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
    if arch == "qwen3" and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if arch == "qwen2":
        fields.setdefault("use_sliding_window", False)
    return AutoConfig.for_model(arch, **fields)


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


def build_truncated_model(src_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """A copy of ``src_dir`` keeping only its first ``num_layers`` decoder layers (embeddings, final
    norm and LM head unchanged): a draft model that shares the source's vocabulary and much of its
    behaviour, for speculative decoding tests and benchmarks."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(src / "model.safetensors"))
    kept = {
        name: w
        for name, w in weights.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, out / extra)
    return out
