"""Weights into a ``DecoderForCausalLM``: from HF safetensors (one file or sharded), from a GGUF
file (dequantized here to the model's dtype), or random ("dummy") from the config alone for
benchmarks. Each HF tensor is taken whole and the slice that
this tensor-parallel rank holds is copied in, so every rank reads the same checkpoint."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from engine_svc.models.decoder import DecoderForCausalLM
from engine_svc.models.gguf_checkpoint import GGUFCheckpoint
from engine_svc.models.model_path import resolve_model_path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def load_weights(
    model: DecoderForCausalLM, model_path: str | Path, unread: frozenset[str] = frozenset()
) -> None:
    """``unread``: GGUF tensor names (HF spelling) not to read, because their blocks serve them: their
    parameters stay unwritten (so never resident) until the load frees them."""
    where = resolve_model_path(model_path)
    tensors = _read_gguf(where.gguf, unread) if where.is_gguf else _read_safetensors(where.root)
    shapes = full_shapes(model)
    loaded = set(unread) | {n for name in unread for n in expert_names_covered(model, name)}
    for name, source, tensor in tensors:
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{source}: shape {tuple(tensor.shape)}, the config needs {shapes[name]}")
        if assign(model, name, tensor):
            loaded.add(name)
            loaded.update(expert_names_covered(model, name))
    missing = set(shapes) - loaded
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def init_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Random weights of the checkpoint's shape, the same on every rank and for every TP size;
    norms stay 1 and biases 0 so activations keep a sane scale."""
    device = model.final_norm.device
    gen = torch.Generator(device).manual_seed(seed)
    std = model.spec.initializer_range
    offset = model.spec.norm_offset  # a (1 + w) norm's w is 0 for a norm of 1
    for name, shape in sorted(full_shapes(model).items()):
        if "norm" in name:
            tensor = torch.full(shape, 1.0 - offset, device=device)
        elif name.endswith("bias"):
            tensor = torch.zeros(shape, device=device)
        else:
            tensor = torch.randn(shape, generator=gen, device=device) * std
        assign(model, name, tensor)


def _read_gguf(path: Path, unread: frozenset[str]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(HF name, where it came from, fp32 tensor): one tensor dequantized at a time, so the load
    never holds a second float copy of the model."""
    for t in GGUFCheckpoint(path).tensors():
        if t.hf_name not in unread:
            yield t.hf_name, f"GGUF tensor {t.gguf_name} ({t.type_name})", t.dequantize()


def _read_safetensors(d: Path) -> Iterator[tuple[str, str, torch.Tensor]]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (d / "model.safetensors").exists():
        files = [d / "model.safetensors"]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {d} (use load_format='dummy' for random weights)")
    for path in files:
        for name, tensor in read_safetensors_file(path):
            yield name, f"tensor {name} in {path.name}", tensor


# safetensors' dtype names -> torch's
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of one safetensors file, in file order, each read into its
    own buffer with plain reads: no mapping of the file, whose touched pages would count in the
    process's resident set until it closed (measured: the 0.5B's 1.2 GB bf16 file doubled the
    load's peak that way). The format: 8 bytes of little-endian header length, a JSON header
    (name -> dtype, shape, [start, end) past the header), the data."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"{path}: header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
        base = 8 + n
        entries = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda e: e[1]["data_offsets"]
        )
        for name, meta in entries:
            dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name} has dtype {meta['dtype']}, not one torch reads")
            start, end = meta["data_offsets"]
            tensor = torch.empty(meta["shape"], dtype=dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if end - start != nbytes or base + end > size:
                raise ValueError(
                    f"{path}: tensor {name} ({meta['dtype']} {meta['shape']}) spans bytes {start}-{end}"
                    f" of a {size - base}-byte data section"
                )
            f.seek(base + start)
            if nbytes and f.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != nbytes:
                raise ValueError(f"{path}: tensor {name} is cut short")
            yield name, tensor


def assign(model: DecoderForCausalLM, name: str, tensor: torch.Tensor) -> bool:
    """Copy this rank's slice of the HF tensor ``name`` into the model; False if not ours. Where
    each tensor goes is the architecture's weight map (``engine_svc/models/arch/``); a ``(1 + w)``
    norm is stored as ``1 + w``."""
    spec, shard = model.spec, model.shard
    decl = spec.arch
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        target = model.embed if name.startswith("model.") else model.lm_head
        start, end = shard.vocab_range(spec)
        return target is not None and _copy(target, tensor[start:end])
    if name == "model.norm.weight":
        return _copy(model.final_norm, _with_offset(tensor, decl.norm_offset))
    m = _LAYER.match(name)
    if not m or int(m.group(1)) >= len(model.layers):
        return False
    layer = model.layers[int(m.group(1))]
    fused = decl.fused_weights.get(m.group(2))
    if fused is not None:  # one HF tensor, the rows of several slots: each slot's rows placed as its own
        sizes = [slot_shapes(spec)[slot][0] for slot in fused]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(
                f"{name}: {tensor.shape[0]} rows, the config needs {sum(sizes)} ({', '.join(fused)})"
            )
        return all(
            _assign_slot(model, layer, slot, part)
            for slot, part in zip(fused, tensor.split(sizes), strict=True)
        )
    found = decl.expert_slot(m.group(2))
    if found is not None:
        return layer.experts is not None and _assign_expert(layer, name, *found, tensor)
    slot = decl.layer_weights.get(m.group(2))
    return slot is not None and _assign_slot(model, layer, slot, tensor)


def _assign_expert(layer, name: str, slot: str, expert: int | None, tensor: torch.Tensor) -> bool:
    """One expert's tensor (``expert`` its index) or every expert's stacked (``expert`` None) into
    the layer's routed experts: gate rows then up rows of each expert's gate/up, its down."""
    experts = layer.experts
    chosen = range(experts.count) if expert is None else [expert]
    if expert is not None and expert >= experts.count:
        raise ValueError(f"{name}: expert {expert}, the config has {experts.count} (num_experts)")
    if expert is None and tensor.shape[0] != experts.count:
        raise ValueError(f"{name}: {tensor.shape[0]} experts stacked, the config has {experts.count}")
    inter = experts.inter
    for e in chosen:
        part = tensor if expert is not None else tensor[e]
        if slot == "experts.down":
            target = experts.down_weights[e].data
        else:
            start, rows = {"experts.gate": (0, inter), "experts.up": (inter, inter)}.get(slot, (0, 2 * inter))
            target = experts.gate_up_weights[e].data.narrow(0, start, rows)
        if tuple(part.shape) != tuple(target.shape):
            raise ValueError(
                f"{name}: shape {tuple(part.shape)} per expert, the config needs {tuple(target.shape)}"
            )
        _copy(target, part)
    return True


def expert_names_covered(model: DecoderForCausalLM, name: str) -> list[str]:
    """The names (``full_shapes``' spelling) that the HF tensor ``name`` fills: itself for a
    per-expert tensor, each expert's for a stacked one, the router's first spelling for any
    router; [] for any other tensor."""
    m = _LAYER.match(name)
    decl = model.spec.arch
    if m and decl.layer_weights.get(m.group(2)) == "router.weight":  # a router of another spelling
        return [f"model.layers.{m.group(1)}.{_router_name(decl)}"]
    found = decl.expert_slot(m.group(2)) if m else None
    if found is None:
        return []
    slot, expert = found
    experts = range(model.spec.layer_experts[int(m.group(1))].count) if expert is None else [expert]
    slots = ("experts.gate", "experts.up") if slot == "experts.gate_up" else (slot,)
    return [_expert_name(model.spec.arch, int(m.group(1)), sl, e) for sl in slots for e in experts]


def _expert_name(decl, layer: int, slot: str, expert: int) -> str:
    """The declaration's per-expert HF name of ``slot`` (its first ``{e}`` pattern)."""
    pattern = next(p for p, sl in decl.expert_weights.items() if sl == slot and "{e}" in p)
    return f"model.layers.{layer}.{pattern.format(e=expert)}"


def _assign_slot(model: DecoderForCausalLM, layer, slot: str, tensor: torch.Tensor) -> bool:
    """Copy this rank's slice of a whole (unsharded) per-layer tensor of ``slot`` into ``layer``."""
    spec, shard = model.spec, model.shard
    decl = spec.arch
    d = spec.head_dim
    heads, kv_heads, inter = layer.num_heads, layer.num_kv_heads, shard.intermediate(spec)
    q_src = shard.rank * heads * d
    kv_src = shard.kv_head_start(spec) * d
    # slot -> (target row offset, source row offset, rows) within the fused qkv projection
    rows = {
        "q_proj": (0, q_src, heads * d),
        "k_proj": (heads * d, kv_src, kv_heads * d),
        "v_proj": ((heads + kv_heads) * d, kv_src, kv_heads * d),
    }
    proj, _, kind = slot.partition(".")
    if proj in rows:
        dst, src, count = rows[proj]
        target = layer.qkv_weight if kind == "weight" else layer.qkv_bias
        return target is not None and _copy(target.data.narrow(0, dst, count), tensor.narrow(0, src, count))
    if proj in ("gate_proj", "up_proj"):
        dst = 0 if proj == "gate_proj" else inter
        return _copy(
            layer.gate_up_weight.data.narrow(0, dst, inter), tensor.narrow(0, shard.rank * inter, inter)
        )
    if slot == "o_proj.weight":
        return _copy(layer.o_weight, tensor.narrow(1, q_src, heads * d))
    if slot == "down_proj.weight":
        return _copy(layer.down_weight, tensor.narrow(1, shard.rank * inter, inter))
    if slot == "o_proj.bias":
        return layer.o_bias is not None and _copy(layer.o_bias, tensor)
    if slot == "router.weight":
        return layer.experts is not None and _copy(layer.experts.router_weight, tensor)
    norm = _norm_params(layer).get(slot)
    return norm is not None and _copy(norm, _with_offset(tensor, decl.norm_offset))


def _norm_params(layer) -> dict:
    """The layer's norm parameters by the declaration's slot (None where the layer has none)."""
    return {
        "q_norm": layer.q_norm,
        "k_norm": layer.k_norm,
        "input_norm": layer.input_norm,
        "attn_out_norm": layer.attn_out_norm,
        "mlp_norm": layer.post_attn_norm,
        "mlp_out_norm": layer.mlp_out_norm,
    }


def _with_offset(tensor: torch.Tensor, offset: float) -> torch.Tensor:
    """A ``(1 + w)`` norm's weight as the kernel multiplies by it: ``1 + w``, in fp32 as HF adds it."""
    return tensor.float() + offset if offset else tensor


def _copy(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
        )
    target.data.copy_(tensor.to(target.dtype))
    return True


def slot_shapes(s) -> dict[str, tuple[int, ...]]:
    """Each per-layer slot this spec's layer has -> its unsharded shape (as HF stores the tensor)."""
    h, d, inter = s.hidden_size, s.head_dim, s.intermediate_size
    q, kv = s.num_heads * d, s.num_kv_heads * d
    by_slot: dict[str, tuple[int, ...]] = {
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "o_proj.weight": (h, q),
        "gate_proj.weight": (inter, h),
        "up_proj.weight": (inter, h),
        "down_proj.weight": (h, inter),
        "input_norm": (h,),
        "mlp_norm": (h,),
    }
    if s.qkv_bias:
        by_slot.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if s.o_bias:
        by_slot["o_proj.bias"] = (h,)
    if s.qk_norm:
        by_slot.update({"q_norm": (d,), "k_norm": (d,)})
    if s.sandwich_norms:
        by_slot.update({"attn_out_norm": (h,), "mlp_out_norm": (h,)})
    return by_slot


def full_shapes(model: DecoderForCausalLM) -> dict[str, tuple[int, ...]]:
    """HF name -> unsharded shape, for every weight the model needs (the declaration's weight map,
    less the slots this model's layer does not have)."""
    s = model.spec
    h = s.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (s.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if model.lm_head is not None:
        shapes["lm_head.weight"] = (s.vocab_size, h)
    by_slot = slot_shapes(s)
    per_layer = {name: by_slot[slot] for name, slot in s.arch.layer_weights.items() if slot in by_slot}
    for name, slots in s.arch.fused_weights.items():  # a fused tensor: its slots' rows stacked
        if all(slot in by_slot for slot in slots):
            per_layer[name] = (sum(by_slot[slot][0] for slot in slots), *by_slot[slots[0]][1:])
    dense_mlp = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    for i in range(s.num_layers):
        experts = s.layer_experts[i] if s.layer_experts else None
        # a routed-experts layer has a router and its experts, a dense one its MLP
        skip = dense_mlp if experts is not None else ("router.weight",)
        for name, shape in per_layer.items():
            if s.arch.layer_weights.get(name) not in skip and name not in s.arch.fused_weights:
                shapes[f"model.layers.{i}.{name}"] = shape
            elif name in s.arch.fused_weights and not set(s.arch.fused_weights[name]) & set(skip):
                shapes[f"model.layers.{i}.{name}"] = shape
        if experts is not None:
            shapes[f"model.layers.{i}.{_router_name(s.arch)}"] = (experts.count, h)
            e_shapes = {
                "experts.gate": (experts.intermediate_size, h),
                "experts.up": (experts.intermediate_size, h),
                "experts.down": (h, experts.intermediate_size),
            }
            for slot, shape in e_shapes.items():
                for e in range(experts.count):
                    shapes[_expert_name(s.arch, i, slot, e)] = shape
    return shapes


def _router_name(decl) -> str:
    return next(name for name, slot in decl.layer_weights.items() if slot == "router.weight")
