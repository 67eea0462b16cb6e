"""Reading a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
into host tensors, checked against the served model: every refusal names the file, module, shape
or limit at fault, and nothing is kept from a refused adapter.

The scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA) is folded into B once
here, so the forward pass computes ``x @ A.T @ B.T`` with no per-step multiply."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.lora.geometry import TARGET_MODULES, targets
from engine_svc.models.spec import ModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter name on save)
KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem."""


@dataclass
class LoRAAdapter:
    """One adapter on the host. ``weights[(layer, module)] = (A [r, in], B * scaling [out, r])``."""

    name: str
    path: str
    rank: int
    scaling: float
    modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    version: int = 0  # the registry's load counter: a reload under the same name is a new version
    int_id: int | None = None

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def read_adapter(
    name: str, path: str | Path, spec: ModelSpec, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    d = Path(path)
    config = _read_config(d)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{d / CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)):
        raise AdapterError(f"{d / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    _refuse_unsupported(d, config)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    geometry = targets(spec)
    raw = _read_tensors(d)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder layer")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in geometry:
            raise AdapterError(
                f"adapter {name!r} targets module {module!r}, which this model does not serve LoRA on "
                f"(supported: {', '.join(TARGET_MODULES)})"
            )
        if layer >= spec.num_layers:
            raise AdapterError(
                f"adapter {name!r} has weights for layer {layer}; the model has {spec.num_layers}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {d / WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"adapter {name!r} layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: has lora_{''.join(ab)} without its pair")
        a, b, t = ab["A"], ab["B"], geometry[module]
        if tuple(a.shape) != (rank, t.in_features):
            raise AdapterError(
                f"{where}: lora_A shape {tuple(a.shape)} != (r={rank}, in_features={t.in_features})"
            )
        if tuple(b.shape) != (t.out_features, rank):
            raise AdapterError(
                f"{where}: lora_B shape {tuple(b.shape)} != (out_features={t.out_features}, r={rank})"
            )
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous())
    modules = frozenset(m for _, m in weights)
    return LoRAAdapter(name, str(d), rank, scaling, modules, weights)


def _read_config(d: Path) -> dict:
    if not d.is_dir():
        raise AdapterError(f"adapter directory {d} does not exist")
    path = d / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in adapter directory {d}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{path}: peft_type is {peft_type!r}; only LORA adapters are served")
    return config


def _refuse_unsupported(d: Path, config: dict) -> None:
    """Options that change the math in ways this forward does not compute."""
    path = d / CONFIG_FILE
    if config.get("use_dora"):
        raise AdapterError(f"{path}: use_dora is not supported")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{path}: fan_in_fan_out is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias {config['bias']!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{path}: {key} is not supported (one r and lora_alpha for every module)")
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save {config['modules_to_save']} is not supported")
    wanted = config.get("target_modules")
    if isinstance(wanted, list):
        unknown = sorted(set(wanted) - set(TARGET_MODULES))
        if unknown:
            raise AdapterError(
                f"{path}: target_modules {unknown} not supported (supported: {', '.join(TARGET_MODULES)})"
            )


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    path = d / WEIGHTS_FILE
    if not path.is_file():
        if (d / "adapter_model.bin").is_file():
            raise AdapterError(f"{d}: adapter_model.bin is not read (pickle); save with safetensors")
        raise AdapterError(f"no {WEIGHTS_FILE} in adapter directory {d}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except Exception as e:  # noqa: BLE001 - any parse failure is the file's fault
        raise AdapterError(f"{path}: not a readable safetensors file ({e})") from None
