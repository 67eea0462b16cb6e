"""The shape of a checkpoint, read from its HF ``config.json`` (both the transformers 4 and 5 forms)
or from a GGUF file's metadata (turned into the same config first)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from engine_svc.models import arch as archs
from engine_svc.models.arch import Architecture, Experts, LayerAttention
from engine_svc.models.model_path import resolve_model_path


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
    sliding_window: int | None  # a window the model is not served with (max_model_len stays inside it)
    eos_token_ids: tuple[int, ...]
    # From the architecture's declaration (engine_svc/models/arch/): per layer, its attention
    # (window, rotary table); the layer's shape; the model's ends.
    layer_attention: tuple[LayerAttention, ...] = ()
    activation: str = "silu"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None  # tanh(s / cap) * cap on every layer's scaled scores
    # per layer, its routed experts (engine_svc/models/routed_experts.py) or None: a dense MLP
    layer_experts: tuple[Experts | None, ...] = ()

    @property
    def arch(self) -> Architecture:
        return archs.by_name(self.architecture)

    @property
    def rope_switch(self) -> int | None:
        """The sequence length past which the model's rotary table changes for the whole sequence
        (``LayerAttention.rope_switch``; one for every kind that has one), or None."""
        switches = {a.rope_switch for a in self.layer_attention} - {None}
        if len(switches) > 1:
            raise ValueError(f"{self.architecture}: layer kinds switch rotary tables at {sorted(switches)}")
        return switches.pop() if switches else None

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
        listed = cfg.get("architectures") or []
        decl = next((a for a in map(archs.by_name, listed) if a is not None), None)
        if decl is None:
            raise ValueError(
                f"unsupported architecture {listed or cfg.get('model_type')!r}; supported: "
                f"{', '.join(archs.names())}"
            )
        if cfg.get("attn_logit_softcapping") and not decl.attn_softcap_key:
            raise ValueError(
                f"{decl.name}: attn_logit_softcapping {cfg['attn_logit_softcapping']} is not supported "
                "(attention scores are not soft-capped)"
            )
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        layer_attention = decl.layers(cfg)
        first_full = next((a for a in layer_attention if a.window is None), layer_attention[0])
        eos = generation_eos if generation_eos is not None else cfg.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        query_scalar = cfg.get(decl.query_scale_key) if decl.query_scale_key else None
        softcap = cfg.get(decl.final_softcap_key) if decl.final_softcap_key else None
        attn_cap = cfg.get(decl.attn_softcap_key) if decl.attn_softcap_key else None
        return cls(
            architecture=decl.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=first_full.rope_theta,
            rope_scaling=first_full.rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=decl.qkv_bias or bool(cfg.get("attention_bias", False)),
            o_bias=not decl.qkv_bias and bool(cfg.get("attention_bias", False)),
            qk_norm=decl.qk_norm,
            initializer_range=cfg.get("initializer_range", 0.02),
            sliding_window=None if decl.window_served else sliding,
            eos_token_ids=eos_ids,
            layer_attention=layer_attention,
            activation=decl.activation,
            norm_offset=decl.norm_offset,
            sandwich_norms=decl.sandwich_norms,
            embed_scale=float(cfg["hidden_size"]) ** 0.5 if decl.scale_embedding else None,
            attn_scale=float(query_scalar) ** -0.5 if query_scalar else None,
            final_logit_softcap=float(softcap) if softcap else None,
            attn_logit_softcap=float(attn_cap) if attn_cap else None,
            layer_experts=decl.experts(cfg),
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
