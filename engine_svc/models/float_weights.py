"""After the linears are built: free each projection's float parameter where its GEMM holds its own
copy of the weight (a packed fp32 or bf16 panel, oneDNN's reordered weight, or quantized blocks),
so that the model holds one copy of every weight instead of two.

What still reads the parameters once the linears are built, and what is kept for it:

- ``linear_backend="dense"`` (``F.linear`` on the parameter, and the only path off the CPU): kept;
- the embedding lookup (``F.embedding`` on ``model.embed``): a tied model's embedding is kept in
  float, except where it is a GGUF file's blocks dequantized and the LM head runs packed: then the
  lookup reads those blocks (``block_embedding.py``) and the float table goes too; an untied
  model's embedding (only the lookup reads it) likewise wherever the load attached the file's
  blocks to it (``quantization="gguf"``: Qwen2.5 Q4_K_M's Q5_0 table, 138 MiB with a byte a
  quant, against 519 MiB in fp32);
- building the linears again (``prepare_linears``): refused once a parameter is freed
  (``kernels.cpu.linear.make_linear`` names it); load the model again instead.

Nothing else does: LoRA adds its delta to a projection's output, a draft model is a model of its
own, tensor-parallel ranks each load their shard, and the quantized blocks the load made or kept
(``quantized_weights.QuantizedBlocks``) were only the linears' input (the packed GEMM holds its own
form), so the load drops them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_svc.gc_freeze import return_freed_memory
from engine_svc.models.block_embedding import from_table
from engine_svc.models.quantized_weights import EMBED, EMBED_NAME, linear_weights

# The linears whose object holds its own copy of the weight (kernels.cpu.linear's kinds).
PACKED_KINDS = ("native", "onednn", "quantized", "quantized_int8act")


def projections(model) -> list[tuple[str, torch.nn.Parameter, object]]:
    """(name, float parameter, the linear built from it) for every projection and the LM head
    (named ``embed`` when it is the tied embedding)."""
    out = []
    for key, param in linear_weights(model).items():
        if key == "lm_head":
            out.append(("embed" if model.lm_head is None else "lm_head", param, model.lm_head_proj))
        elif key.count(".") == 4:  # an expert's: layers.{i}.experts.{e}.{gate_up,down}_weight
            _, i, _, e, weight = key.split(".")
            linears = getattr(model.layers[int(i)].experts, weight.replace("_weight", "_projs"))
            out.append((key, param, linears[int(e)]))
        else:
            _, i, weight = key.split(".")
            out.append((key, param, getattr(model.layers[int(i)], weight.replace("_weight", "_proj"))))
    return out


@dataclass
class Freed:
    """What the load freed so far: per parameter (``projections``' names) why, and the bytes."""

    released: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    projections: int = 0


def free_layer_weights(model, index: int | None, freed: Freed) -> None:
    """Free layer ``index``'s projection parameters that its packed linears made redundant (None:
    an untied LM head's), as soon as they are built (``prepare_linears``' ``after_layer``): the
    load's peak then holds one layer's weights twice, not the whole model's. A tied embedding is
    left to ``free_packed_float_weights`` (its lookup may still read it)."""
    prefix = "lm_head" if index is None else f"layers.{index}."
    for name, param, linear in projections(model):
        kind = getattr(linear, "kind", "dense")
        if name.startswith(prefix) and kind in PACKED_KINDS and name not in freed.released:
            _release(param, f"{name} runs on its {kind} linear's own copy", freed, name)
            freed.projections += 1


def free_packed_float_weights(
    model, quantized=None, unread: frozenset[str] = frozenset(), freed: Freed | None = None
) -> tuple[str, dict[str, str]]:
    """Free the float parameters that a packed linear made redundant (``quantized``: the load's
    ``QuantizedBlocks``, whose embedding blocks a lookup may read instead); returns the log's
    summary and, per parameter freed (``projections``' names), why (the load's
    ``LoadResult.released``). ``unread``: the checkpoint names the load left unread
    (``quantized_weights.served_by_blocks``): where the embedding is one, its table was never
    dequantized and the lookup is its blocks'. ``freed``: what ``free_layer_weights`` freed
    already."""
    quantized = quantized or {}
    freed = freed or Freed()
    kept, notes, released = set(), [], freed.released
    table_unread = EMBED_NAME in unread
    for name, param, linear in projections(model):
        blocks = quantized.get("lm_head" if name == "embed" else name)
        kind = getattr(linear, "kind", "dense")
        if name == "embed":
            packed = kind in PACKED_KINDS and model.shard.size == 1
            lookup = from_table(None if table_unread else param.data, blocks) if packed else None
            if lookup is None:
                kept.add("the tied embedding (the lookup reads it)")
                continue
            model.embed_blocks = lookup
            _release(param, f"the lookup reads the file's {blocks.fmt} blocks", freed, name)
            notes.append(_lookup_note(lookup, blocks.fmt))
        elif kind not in PACKED_KINDS:
            kept.add(f"{kind} linears (they read them)")
        elif name not in released:
            _release(param, f"{name} runs on its {kind} linear's own copy", freed, name)
            freed.projections += 1
    embed = model.embed
    blocks = quantized.get(EMBED)
    if model.lm_head is not None and blocks is not None and model.shard.size == 1:  # untied
        lookup = from_table(None if table_unread else embed.data, blocks)
        if lookup is not None:
            model.embed_blocks = lookup
            _release(embed, f"the lookup reads the file's {blocks.fmt} blocks", freed, "embed")
            notes.append(_lookup_note(lookup, blocks.fmt))
    model.invalidate()  # parameters' storage swapped (``_release``): the native loop's pointers go
    return_freed_memory()  # the released weights' pages
    summary = (
        f"float parameters freed: {freed.projections} projections{' and the embedding' if notes else ''}"
    )
    summary += f" ({freed.nbytes / 2**20:.0f} MiB)" + "".join(f"; {n}" for n in notes)
    return summary + (f"; kept: {', '.join(sorted(kept))}" if kept else ""), released


def _lookup_note(lookup, fmt: str) -> str:
    where = "in the file's mapping" if lookup.reads_the_file else "(a copy)"
    return f"the embedding lookup reads its {fmt} blocks {where} ({lookup.nbytes / 2**20:.0f} MiB)"


def _release(param: torch.nn.Parameter, why: str, freed: Freed, name: str) -> None:
    """Drop ``param``'s storage (an empty tensor is left), note why as ``freed.released[name]``
    and count its bytes."""
    freed.nbytes += param.numel() * param.element_size()
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    freed.released[name] = f"freed at load: {why}"


def linear_shapes(model) -> dict[str, tuple[int, int]]:
    """(out, in) of every projection and the LM head, from the model's geometry (the parameters
    may be freed)."""
    spec = model.spec
    h, d = spec.hidden_size, spec.head_dim
    out = {}
    for i, layer in enumerate(model.layers):
        q, kv = layer.num_heads * d, layer.num_kv_heads * d
        inter = layer.shard.intermediate(spec)
        out[f"layers.{i}.qkv_weight"] = (q + 2 * kv, h)
        out[f"layers.{i}.o_weight"] = (h, q)
        if layer.experts is None:
            out[f"layers.{i}.gate_up_weight"] = (2 * inter, h)
            out[f"layers.{i}.down_weight"] = (h, inter)
        else:
            for e in range(layer.experts.count):
                out[f"layers.{i}.experts.{e}.gate_up_weight"] = (2 * layer.experts.inter, h)
                out[f"layers.{i}.experts.{e}.down_weight"] = (h, layer.experts.inter)
    start, end = model.shard.vocab_range(spec)
    out["lm_head"] = (end - start, h)  # this rank's vocabulary rows
    return out
