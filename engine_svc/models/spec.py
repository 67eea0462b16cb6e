"""The shape of a checkpoint, read from its HF ``config.json`` (both the transformers 4 and 5 forms)
or from a GGUF file's metadata (turned into the same config first)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from engine_svc.models.model_path import resolve_model_path

# architecture name in config.json -> the family flags our one decoder implementation needs
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    initializer_range: float
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_path(cls, model: str | Path) -> ModelSpec:
        """An HF directory, a GGUF file, or a directory holding one GGUF file."""
        where = resolve_model_path(model)
        if where.is_gguf:
            from engine_svc.models.gguf_checkpoint import GGUFCheckpoint

            return cls.from_dict(GGUFCheckpoint(where.gguf).config())
        cfg = json.loads((where.root / "config.json").read_text())
        spec = cls.from_dict(cfg, _generation_eos(where.root))
        if not spec.eos_token_ids:  # as vLLM: the tokenizer's end-of-sequence token
            eos = _tokenizer_eos(where.root)
            if eos is not None:
                spec = dataclasses.replace(spec, eos_token_ids=(eos,))
        return spec

    @classmethod
    def from_dict(cls, cfg: dict, generation_eos: list[int] | None = None) -> ModelSpec:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        heads = cfg["num_attention_heads"]
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        eos = generation_eos if generation_eos is not None else cfg.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias"] or bool(cfg.get("attention_bias", False)),
            o_bias=not flags["qkv_bias"] and bool(cfg.get("attention_bias", False)),
            qk_norm=flags["qk_norm"],
            initializer_range=cfg.get("initializer_range", 0.02),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
        )


def _tokenizer_eos(d: Path) -> int | None:
    """The id of ``tokenizer_config.json``'s ``eos_token`` in ``tokenizer.json`` (None: either
    file or the token is missing)."""
    try:
        config = json.loads((d / "tokenizer_config.json").read_text())
        vocab = json.loads((d / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    for t in vocab.get("added_tokens") or []:
        if t.get("content") == eos and isinstance(t.get("id"), int):
            return t["id"]
    found = ((vocab.get("model") or {}).get("vocab") or {}).get(eos)
    return found if isinstance(found, int) else None


def _generation_eos(d: Path) -> list[int] | None:
    path = d / "generation_config.json"
    if not path.exists():
        return None
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return None
    return eos if isinstance(eos, list) else [eos]
