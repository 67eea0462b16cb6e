"""Draft models for speculative-decoding tests and benchmarks, cut from a target's own checkpoint."""

from __future__ import annotations

from pathlib import Path


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
