"""Weights into a ``DecoderForCausalLM``: from HF safetensors (one file or sharded), or random
("dummy") from config.json alone for benchmarks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.models.decoder import DecoderForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def load_weights(model: DecoderForCausalLM, model_dir: str | Path) -> None:
    files = _safetensors_files(Path(model_dir))
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if _assign(model, name, f.get_tensor(name)):
                    loaded.add(name)
    missing = _expected_names(model) - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def init_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Random weights of the checkpoint's shape; norms stay 1 so activations keep a sane scale."""
    gen = torch.Generator().manual_seed(seed)
    std = model.spec.initializer_range
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            param.data.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [d / f for f in sorted(set(weight_map.values()))]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {d} (use load_format='dummy' for random weights)")
    return found


def _assign(model: DecoderForCausalLM, name: str, tensor: torch.Tensor) -> bool:
    spec = model.spec
    if name == "model.embed_tokens.weight":
        return _copy(model.embed, tensor)
    if name == "model.norm.weight":
        return _copy(model.final_norm, tensor)
    if name == "lm_head.weight":
        return model.lm_head is not None and _copy(model.lm_head, tensor)
    m = _LAYER.match(name)
    if not m or int(m.group(1)) >= len(model.layers):
        return False
    layer, rest = model.layers[int(m.group(1))], m.group(2)
    q_rows = spec.num_heads * spec.head_dim
    kv_rows = spec.num_kv_heads * spec.head_dim
    qkv_slices = {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows), "v_proj": (q_rows + kv_rows, kv_rows)}
    inter = spec.intermediate_size
    simple = {
        "self_attn.o_proj.weight": layer.o_weight,
        "self_attn.o_proj.bias": layer.o_bias,
        "self_attn.q_norm.weight": layer.q_norm,
        "self_attn.k_norm.weight": layer.k_norm,
        "mlp.down_proj.weight": layer.down_weight,
        "input_layernorm.weight": layer.input_norm,
        "post_attention_layernorm.weight": layer.post_attn_norm,
    }
    if rest in simple:
        return simple[rest] is not None and _copy(simple[rest], tensor)
    proj, _, kind = rest.removeprefix("self_attn.").removeprefix("mlp.").partition(".")
    if proj in qkv_slices:
        start, rows = qkv_slices[proj]
        target = layer.qkv_weight if kind == "weight" else layer.qkv_bias
        return target is not None and _copy(target.data.narrow(0, start, rows), tensor)
    if proj in ("gate_proj", "up_proj") and kind == "weight":
        start = 0 if proj == "gate_proj" else inter
        return _copy(layer.gate_up_weight.data.narrow(0, start, inter), tensor)
    return False


def _copy(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"weight shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
    target.data.copy_(tensor.to(target.dtype))
    return True


def _expected_names(model: DecoderForCausalLM) -> set[str]:
    spec = model.spec
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if model.lm_head is not None:
        names.add("lm_head.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names |= {p + s for s in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight", "input_layernorm.weight",
                                  "post_attention_layernorm.weight")}
        if spec.qkv_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if spec.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names
