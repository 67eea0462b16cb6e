"""Architectures as declarations: each module here states one architecture's layers as data (an
``Architecture``) and registers it; the spec, the loader, the GGUF reader, the quantized weights and
the decoder read the declaration instead of branching on a name.

What an architecture declares:

- its names: the HF ``architectures`` entry and GGUF's ``general.architecture``;
- the layer: QKV bias, per-head q/k RMSNorm, the gated MLP's activation (``silu`` or
  ``gelu_tanh``), the RMSNorm style (``w`` or ``1 + w``: ``norm_offset``), whether the attention's
  and the MLP's outputs are normed too (``sandwich_norms``), the embedding's scale (by
  ``sqrt(hidden)``), final-logit soft-capping;
- per layer, its attention (``LayerAttention``: full or a sliding window of W tokens, and the
  rotary base and scaling of that kind), read from the config by ``layers``;
- one weight map: each HF per-layer tensor suffix to the decoder's slot (``layer_weights``), each
  fused HF tensor to the slots its rows hold in order (``fused_weights``: Phi-3's ``qkv_proj`` is
  q, k, v), and each GGUF per-layer suffix to the HF one (``gguf_names``), and what llama.cpp's converter
  changed on the way (``gguf_permuted_qk``: the q/k row order; ``norm_offset``: norms stored as
  ``1 + w``);
- per layer, its routed experts (``Experts``: E, top-k, the experts' width and the routing rule;
  None for a dense MLP layer), read from the config by ``experts``, and where their tensors are
  (``expert_weights``: an HF suffix with ``{e}`` names one expert's tensor, one without names the
  tensor of every expert stacked on a leading dimension, as GGUF's ``ffn_*_exps`` and
  transformers 5's fused ``gate_up_proj`` are);
- which engine features were tested on it (``features``); the others refuse it at start;
- its random tiny test model: transformers' ``model_type`` and the config defaults
  (``tiny_config``) that ``engine_svc.models.build`` builds it from, by ``short_name`` (default: the
  ``model_type``; by convention the module's name).

Every module in this package is imported (``pkgutil``) on the first lookup and registers its
declarations: adding an architecture of a known kind is one module here (see ``smollm3.py``,
``gemma3.py``) and its test file; nothing else lists architectures (``tests/test_arch_registry.py``
fails if something does). docs/architecture.md, "Adding an architecture".
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# The decoder's per-layer weight slots (engine_svc/models/decoder.py): q/k/v rows of the fused
# qkv projection, gate/up rows of the fused gate_up one, and the norms.
SLOTS = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight",
    "q_proj.bias", "k_proj.bias", "v_proj.bias",
    "o_proj.weight", "o_proj.bias",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "q_norm", "k_norm",
    "input_norm",  # before attention
    "attn_out_norm",  # on the attention's output (sandwich norms)
    "mlp_norm",  # before the MLP
    "mlp_out_norm",  # on the MLP's output (sandwich norms)
    "router.weight",  # a routed-experts layer's router ([E, hidden])
)  # fmt: skip
# A routed-experts layer's expert slots: each expert's gate and up rows (or both, gate first) and
# its down projection.
EXPERT_SLOTS = ("experts.gate", "experts.up", "experts.gate_up", "experts.down")

# Engine features an architecture may declare tested (the rest refuse it at start).
FEATURES = ("lora", "speculative", "tensor_parallel")
FEATURE_NAMES = {
    "lora": "LoRA adapters",
    "speculative": "speculative decoding",
    "tensor_parallel": "tensor parallelism (tensor_parallel_size > 1)",
}

# The Llama family's HF names; an architecture adds or overrides entries.
LLAMA_LAYER_WEIGHTS = {
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.q_proj.bias": "q_proj.bias",
    "self_attn.k_proj.bias": "k_proj.bias",
    "self_attn.v_proj.bias": "v_proj.bias",
    "self_attn.o_proj.weight": "o_proj.weight",
    "self_attn.o_proj.bias": "o_proj.bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "mlp_norm",
}
# llama.cpp's per-layer tensor names -> HF's, for the Llama family.
LLAMA_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention: ``window`` None is full attention, else a query sees the last
    ``window`` positions (its own included); the rotary table of its kind."""

    window: int | None
    rope_theta: float
    rope_scaling: dict | None = None

    def rope_key(self) -> tuple:
        return (self.rope_theta, repr(sorted((self.rope_scaling or {}).items())))

    @property
    def rope_switch(self) -> int | None:
        """A sequence longer than this many tokens is rotated whole by another table, its earlier
        positions too (long-rope: the original context length); None: a token's rotation depends
        on its position alone. The KV cache recomputes a sequence that grows past it and keeps
        the two tables' blocks apart (docs/models.md, *Long-rope*)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            return int(scaling["original_max_position_embeddings"])
        return None


@dataclass(frozen=True)
class Experts:
    """One layer's routed experts: ``count`` experts of width ``intermediate_size``, ``top_k`` of
    them per token. The rule (both Qwen3-MoE's and Mixtral's): the router's logits, a softmax in
    fp32 over all ``count``, the ``top_k`` largest (ties to the lower index, as ``torch.topk``),
    divided by their sum when ``renormalize`` (Mixtral always; Qwen3-MoE when ``norm_topk_prob``;
    a softmax over only the top-k logits is the same weights up to rounding)."""

    count: int
    top_k: int
    intermediate_size: int
    renormalize: bool

    def __post_init__(self):
        if not 1 <= self.top_k <= self.count:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be 1..{self.count} (the number of experts)"
            )


def no_experts(cfg: dict) -> tuple[Experts | None, ...]:
    return (None,) * cfg["num_hidden_layers"]


def rope_of(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) of a Llama-style config (transformers 4's ``rope_theta``/``rope_scaling``
    or 5's ``rope_parameters``)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(cfg.get("rope_theta", params.get("rope_theta", 10000.0))), scaling


def full_attention_layers(cfg: dict) -> tuple[LayerAttention, ...]:
    """Every layer full attention with the config's one rotary table (the Llama family)."""
    theta, scaling = rope_of(cfg)
    return (LayerAttention(None, theta, scaling),) * cfg["num_hidden_layers"]


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json's ``architectures`` entry
    gguf: str | None  # GGUF's general.architecture
    layers: Callable[[dict], tuple[LayerAttention, ...]] = full_attention_layers
    qkv_bias: bool = False
    qk_norm: bool = False
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    norm_offset: float = 0.0  # 1.0: every RMSNorm multiplies by (1 + w)
    sandwich_norms: bool = False  # the attention's and the MLP's outputs are normed before the residual add
    scale_embedding: bool = False  # the embedding's rows times sqrt(hidden)
    # (HF config key of the attention's query scale: scores * key ** -0.5; None: head_dim)
    query_scale_key: str | None = None
    final_softcap_key: str | None = None  # HF config key of the final logits' tanh soft-cap
    # HF config key of the attention scores' tanh soft-cap (Gemma 2: tanh(s / cap) * cap on the
    # scaled scores, before the mask and softmax)
    attn_softcap_key: str | None = None
    # The config's sliding_window: a window this declaration does not serve per layer (then
    # max_model_len stays inside it), or served by ``layers``.
    window_served: bool = False
    layer_weights: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER_WEIGHTS))
    # A fused HF tensor -> the slots its rows hold, in order (each slot's rows from the geometry)
    fused_weights: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    gguf_names: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_GGUF_NAMES))
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved the q/k rows (Llama family)
    # The GGUF architecture llama.cpp's converter writes this one as, where not ``gguf`` (Mistral:
    # llama; such a file reads as that architecture's declaration, the same decoder)
    gguf_converted: str | None = None
    # GGUF metadata -> HF config keys this architecture needs beyond the common ones
    gguf_config: Callable[[object], dict] = lambda ckpt: {}
    features: frozenset[str] = frozenset(FEATURES)
    # Per layer, its routed experts or None (a dense MLP), read from the config
    experts: Callable[[dict], tuple[Experts | None, ...]] = no_experts
    # HF per-layer suffix -> expert slot (EXPERT_SLOTS): with ``{e}``, one expert's 2-D tensor;
    # without, every expert's, stacked ([E, rows, cols])
    expert_weights: Mapping[str, str] = field(default_factory=dict)
    # A GGUF file of ``gguf`` with ``expert_count`` is this one (llama.cpp writes Mixtral as llama)
    gguf_experts: bool = False
    # transformers' config ``model_type`` (``AutoConfig.for_model``: the random tiny test model's)
    model_type: str | None = None
    # The name ``engine_svc.models.build`` builds the tiny model by (``build_random_model(out,
    # short_name)``); None: the ``model_type``
    short_name: str | None = None
    # That model's config beyond build's common shape (vocab 512, hidden 64, 2 layers, 4 heads, 2 KV
    # heads); ``head_dim: None`` fills in hidden // heads (for a config whose own default differs)
    tiny_config: Mapping[str, object] = field(default_factory=dict)

    @property
    def build_name(self) -> str | None:
        return self.short_name or self.model_type

    @property
    def gguf_written(self) -> str | None:
        """The GGUF architecture llama.cpp's converter gives a file of this one."""
        return self.gguf_converted or self.gguf

    def expert_slot(self, suffix: str) -> tuple[str, int | None] | None:
        """(slot, expert index or None for a stacked tensor) of an HF per-layer suffix, or None."""
        for pattern, slot in self.expert_weights.items():
            if "{e}" not in pattern:
                if suffix == pattern:
                    return slot, None
                continue
            head, tail = pattern.split("{e}")
            if suffix.startswith(head) and suffix.endswith(tail):
                index = suffix[len(head) : len(suffix) - len(tail)]
                if index.isdigit():
                    return slot, int(index)
        return None

    def hf_sources(self, slots: tuple[str, ...]) -> list[str] | None:
        """The HF per-layer suffixes whose rows make the decoder's fused linear of ``slots`` (in
        that order): one fused tensor holding exactly them, or one tensor per slot; None if the
        weight map has neither."""
        for name, held in self.fused_weights.items():
            if tuple(held) == tuple(slots):
                return [name]
        by_slot = {slot: name for name, slot in self.layer_weights.items()}
        names = [by_slot.get(slot) for slot in slots]
        return None if None in names else names

    def __post_init__(self):
        assert self.activation in ("silu", "gelu_tanh"), self.activation
        assert set(self.layer_weights.values()) <= set(SLOTS), set(self.layer_weights.values()) - set(SLOTS)
        fused = {slot for slots in self.fused_weights.values() for slot in slots}
        assert fused <= set(SLOTS), fused - set(SLOTS)
        assert not fused & set(self.layer_weights.values()), fused & set(self.layer_weights.values())
        assert set(self.features) <= set(FEATURES), self.features
        assert set(self.expert_weights.values()) <= set(EXPERT_SLOTS), self.expert_weights
        assert self.short_name is None or self.model_type, "short_name names a tiny model: model_type too"


_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    _REGISTRY[arch.name] = arch
    return arch


_LOADED = False


def _load_all() -> None:
    """Import every module of this package (each registers its declarations), in name order."""
    global _LOADED
    if _LOADED:
        return
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _LOADED = True


def by_name(name: str) -> Architecture | None:
    _load_all()
    return _REGISTRY.get(name)


def by_gguf(name: str, experts: bool = False) -> Architecture | None:
    """The declaration of GGUF architecture ``name``; ``experts``: the file has routed experts
    (``<arch>.expert_count``), which picks a declaration marked ``gguf_experts`` of that name."""
    _load_all()
    found = [a for a in _REGISTRY.values() if a.gguf == name]
    return next((a for a in found if a.gguf_experts == experts), found[0] if found else None)


def names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def all_archs() -> list[Architecture]:
    """Every registered declaration, by HF name."""
    _load_all()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def by_build_name(name: str) -> Architecture | None:
    """The declaration whose random tiny test model is built by ``name`` (``build_name``)."""
    _load_all()
    return next((a for a in _REGISTRY.values() if a.build_name == name), None)


def build_names() -> list[str]:
    _load_all()
    return sorted(a.build_name for a in _REGISTRY.values() if a.build_name)


def gguf_names() -> list[str]:
    _load_all()
    return sorted({a.gguf for a in _REGISTRY.values() if a.gguf})  # (Mixtral shares llama's)


def refuse_untested(arch: Architecture, wanted: dict[str, bool]) -> None:
    """A clear error for an engine feature asked for that ``arch`` does not declare tested."""
    for feature, on in wanted.items():
        if on and feature not in arch.features:
            raise ValueError(
                f"{FEATURE_NAMES[feature]} is not supported on architecture {arch.name} (tested on it: "
                f"{', '.join(FEATURE_NAMES[f] for f in sorted(arch.features)) or 'none of them'})"
            )
