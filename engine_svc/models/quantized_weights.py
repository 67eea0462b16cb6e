"""Quantized weights for the model's linears: a GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL, IQ4_XS and the K-quants Q2_K..Q6_K: ``quant_gemm.FORMATS``), kept (``attach_gguf_blocks``),
or blocks made at load from the float weights (``quantize_linears``: ``int8`` -> Q8_0, ``int4`` ->
Q4_1, 32 weights a block). The load holds them in one declared map, ``QuantizedBlocks`` (fused
parameter name, as ``linear_weights`` names it -> its blocks), which ``prepare_linears`` hands to
``kernels.cpu.linear.make_linear``: it builds that projection on the quantized GEMM
(``kernels/cpu/quant_gemm.py``). Once built, the linear holds the only copy: the loader frees the
float parameter and drops the blocks (``engine_svc/models/float_weights.py``; kept with
``linear_backend="dense"``, and a tied embedding, which the lookup reads).

``quantization`` (EngineConfig): None = auto (a GGUF file's blocks where the kernel has their
format and no float ``dtype`` was asked for, else as loaded), ``"none"``, ``"gguf"``, ``"int8"``,
``"int4"``.

``quantized_activations`` (EngineConfig): what those blocks multiply. ``"int8"``: the activations
quantized per call to int8 (``kernels/cpu/quant_int8act.py``, integer dot products, as llama.cpp);
``"none"``: fp32 (``quant_gemm.py``, bit-equal to the fp32 model on the dequantized weights). None
= auto = ``DEFAULT_ACTIVATIONS``, chosen by measurement (docs/quantization.md). It is one choice
per engine, never per batch size: a row's result must not depend on what shares its step.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from engine_svc.models import arch as archs
from engine_svc.models.gguf_checkpoint import GGUFCheckpoint, _unpermute_rows
from kernels.cpu import native_gemm, quant_gemm, quant_int8act

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "gguf", "int8", "int4")
_MADE = {"int8": "Q8_0", "int4": "Q4_1"}
ACTIVATIONS = ("auto", "int8", "none")
EMBED = "embed"  # gguf_blocks' key for an untied embedding's blocks (the lookup's, not a linear's)
EMBED_NAME = "model.embed_tokens.weight"
# GGUF's 16-bit float types: a linear whose every part is one of them runs on the native GEMM's
# 16-bit panels (kernels/cpu/native_gemm.py), its values as stored, widened exactly in registers.
HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
DEFAULT_ACTIVATIONS = "int8"


def resolve_quantization(requested: str | None, *, is_gguf: bool, dtype_given: bool, device, tp: int) -> str:
    """The quantization this load runs: ``none``, ``gguf``, ``int8`` or ``int4``. An explicit
    choice that cannot run is an error naming why; auto falls back to ``none`` with a log line."""
    if requested is not None and requested not in (*QUANTIZATIONS, "auto"):
        raise ValueError(f"quantization must be one of {('auto', *QUANTIZATIONS)}, got {requested!r}")
    if requested in (None, "auto"):
        if not is_gguf:
            return "none"
        reason = _unusable(device, tp) or ("a float dtype was asked for" if dtype_given else None)
        if reason:
            log.info("GGUF blocks dequantized (%s)", reason)
            return "none"
        return "gguf"
    if requested == "none":
        return "none"
    if requested == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a GGUF model file")
    reason = _unusable(device, tp)
    if reason:
        raise ValueError(f"quantization={requested!r} is unavailable: {reason}")
    return requested


def _unusable(device, tp: int) -> str | None:
    if tp != 1:
        return f"tensor_parallel_size is {tp} (quantized weights are served unsharded only)"
    return quant_gemm.unusable_reason(torch.device(device))


def linear_weights(model) -> dict[str, torch.Tensor]:
    """Fused parameter name -> parameter, for every linear (the LM head: the embedding when tied)."""
    out = {}
    for i, layer in enumerate(model.layers):
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            if getattr(layer, name) is not None:  # a routed-experts layer has no dense MLP
                out[f"layers.{i}.{name}"] = getattr(layer, name)
        if layer.experts is not None:  # each expert's gate/up and down: layers.{i}.experts.{e}.{name}
            for e in range(layer.experts.count):
                out[f"layers.{i}.experts.{e}.gate_up_weight"] = layer.experts.gate_up_weights[e]
                out[f"layers.{i}.experts.{e}.down_weight"] = layer.experts.down_weights[e]
    out["lm_head"] = model.embed if model.lm_head is None else model.lm_head
    return out


# What the load made or kept of each linear's weights in quantized blocks: ``linear_weights`` key
# (and ``EMBED`` for an untied embedding's lookup) -> its blocks. The one channel from the load to
# ``prepare_linears`` and ``float_weights.free_packed_float_weights``: nothing is set on a parameter.
QuantizedBlocks = dict


def attach_gguf_blocks(
    model, found: tuple[dict[str, quant_gemm.QuantizedWeight], Counter]
) -> tuple[QuantizedBlocks, str]:
    """The file's blocks (``gguf_blocks``) of every fused linear whose parts all have a format the
    kernel runs (a part of another format leaves it float), and an untied embedding's, for its
    lookup (``float_weights.py``), checked against the model's shapes; and a summary for the log
    (formats and counts of the linears')."""
    blocks, skipped = found
    targets = {**linear_weights(model), EMBED: model.embed}
    made: Counter = Counter()
    for key, qw in blocks.items():
        param = targets[key]
        if qw.shape != tuple(param.shape):
            raise ValueError(f"GGUF blocks for {key}: shape {qw.shape}, the model needs {tuple(param.shape)}")
        if key != EMBED:
            made[qw.fmt] += 1
    summary = ", ".join(f"{n} x {f}" for f, n in sorted(made.items()))
    experts = sum(1 for key in blocks if _expert_of(key) is not None)
    if experts:  # each expert's rows of the file's stacked ffn_*_exps blocks
        summary += f", of which {experts} routed experts' linears"
    if skipped:
        summary += "; float: " + ", ".join(f"{n} x {f}" for f, n in sorted(skipped.items()))
    return QuantizedBlocks(blocks), summary


def gguf_blocks(model, gguf_path: str | Path) -> tuple[dict[str, LazyBlocks], Counter]:
    """The file's blocks for each of ``model``'s fused linears (keys as ``linear_weights``) that has
    them all in formats the kernel runs, in the model's row order (parts of different formats read
    as a ``MixedRows``), and for an untied embedding (key ``EMBED``: its lookup may read them),
    each as ``LazyBlocks`` over the file's mapping; and the count of tensors left float, by type.
    Reads only the model's layout, never its weights (they may be freed)."""
    ckpt = GGUFCheckpoint(gguf_path)
    half_gemm = native_gemm.library() is not None
    parts: dict[str, _Part | list[_Part]] = {}
    skipped: Counter = Counter()
    for t in ckpt.tensors():
        if len(t.shape) not in (2, 3):
            continue
        if t.type_name in HALF_TYPES and len(t.shape) == 2 and t.hf_name != EMBED_NAME and half_gemm:
            parts[t.hf_name] = _Part(
                t.type_name, t._reader_tensor.data, tuple(t.shape), t._permute_heads, t.gguf_name
            )
            continue
        if t.type_name not in quant_gemm.FORMATS:
            skipped[t.type_name] += 1
            name, kind = t.gguf_name, t.type_name
            log.info("tensor %s (%s %s): dequantized, no kernel for %s", name, kind, t.shape, kind)
            continue
        log.debug("tensor %s (%s %s): served from its blocks", t.gguf_name, t.type_name, t.shape)
        if len(t.shape) == 3:  # stacked experts [E, rows, cols]: each expert its row range of the blocks
            count, rows, cols = t.shape
            data = t._reader_tensor.data.reshape(count * rows, -1)
            parts[t.hf_name] = [
                _Part(t.type_name, data[e * rows : (e + 1) * rows], (rows, cols), None, f"{t.gguf_name}[{e}]")
                for e in range(count)
            ]
            continue
        parts[t.hf_name] = _Part(
            t.type_name, t._reader_tensor.data, tuple(t.shape), t._permute_heads, t.gguf_name
        )
    tied = model.lm_head is None
    out = {}
    for key in linear_weights(model):
        names = sources(key, tied, model.spec.arch)
        if not names or not all(n in parts for n in names):
            continue
        expert = _expert_of(key)
        found = [parts[n] if expert is None else parts[n][expert] for n in names]
        halves = {p.fmt for p in found if p.fmt in HALF_TYPES}
        if halves and (len(halves) > 1 or len(halves) < len({p.fmt for p in found})):
            continue  # 16-bit float parts beside other types: the linear is loaded as float
        out[key] = LazyBlocks(found)
    used = {n for key in out for n in sources(key, tied, model.spec.arch)}
    for n, p in parts.items():
        if not isinstance(p, list) and p.fmt in HALF_TYPES and n not in used:
            skipped[p.fmt] += 1
            why = f"no kernel for {p.fmt} beside other types"
            log.info("tensor %s (%s %s): dequantized, %s", p.name, p.fmt, p.shape, why)
    if not tied and EMBED_NAME in parts:
        out[EMBED] = LazyBlocks([parts[EMBED_NAME]])
    embed = ckpt.tensor(EMBED_NAME) if EMBED_NAME in parts else None
    if embed is not None:  # the lookup reads the file's own bytes (block_embedding.py), not a copy
        raw = embed._reader_tensor.data
        key = "lm_head" if tied else EMBED
        if key in out and embed._permute_heads is None:
            out[key].raw = raw.reshape(out[key].shape[0], -1)
    return out, skipped


class _Part:
    """One GGUF tensor's blocks (a view of the file's mapping) as a linear's rows: its format, the
    raw ``[rows, row bytes]`` bytes, the ``(rows, cols)`` shape, the head permutation to undo and
    the file's name for it (the log's)."""

    def __init__(self, fmt: str, raw, shape: tuple[int, int], permute_heads, name: str):
        self.fmt, self.raw, self.shape, self.permute_heads = fmt, raw, shape, permute_heads
        self.name = name

    def read(self) -> quant_gemm.QuantizedWeight | torch.Tensor:
        if self.fmt in HALF_TYPES:  # the values as stored, for the native GEMM's 16-bit panels
            bits = np.ascontiguousarray(self.raw).view(np.uint8).view("<u2").reshape(self.shape).copy()
            values = torch.from_numpy(bits).view(HALF_TYPES[self.fmt])
            if self.permute_heads is not None:
                values = values[_unpermute_rows(torch.arange(self.shape[0]), self.permute_heads)]
            return values
        qw = quant_gemm.from_gguf_blocks(self.fmt, self.raw, self.shape)
        if self.permute_heads is not None:
            qw = qw.rows(_unpermute_rows(torch.arange(self.shape[0]), self.permute_heads))
        return qw


class LazyBlocks:
    """A fused linear's GGUF blocks, read into the kernels' format-neutral form
    (``quant_gemm.QuantizedWeight``: a byte a weight plus fp32 scales, 1.5-2x the file's bytes)
    only while its linear is packed: ``kernels.cpu.linear.make_linear`` calls ``materialize()``,
    packs, then ``release()``. Reading every tensor up front held the whole model in that form at
    once (measured: Qwen2.5-Coder-1.5B Q4_K_M, 1,066 MiB, peaked at 7.2 GiB while loading).
    ``fmt`` and ``shape`` come from the file's metadata; any other attribute reads the form."""

    def __init__(self, parts: list[_Part]):
        self._parts = parts
        runs = [p.fmt for i, p in enumerate(parts) if i == 0 or parts[i - 1].fmt != p.fmt]
        self.fmt = runs[0] if len(runs) == 1 else "+".join(runs)  # as concat_rows names it
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.activations = "fp32"
        self.raw = None
        self._read = None

    def materialize(self) -> quant_gemm.QuantizedWeight | quant_gemm.MixedRows:
        if self._read is None and self.fmt in HALF_TYPES:
            self._read = torch.cat([p.read() for p in self._parts])
        if self._read is None:
            read = quant_gemm.concat_rows([p.read() for p in self._parts])
            read.activations = self.activations
            if self.raw is not None:
                read.raw = self.raw
            self._read = read
        return self._read

    def release(self) -> None:
        self._read = None

    def __getattr__(self, name: str):  # only for what the class does not hold itself
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)


def served_by_blocks(model, blocks: dict[str, quant_gemm.QuantizedWeight]) -> frozenset[str]:
    """The checkpoint names whose float tensors the load need not read when ``blocks`` will serve
    their linears (packed, so that the float parameter is freed unread): every part of those
    linears, and the embedding where its lookup will read its blocks (``lookup_blocks``): the
    table is then never dequantized (Qwen2.5-Coder-1.5B: 890 MiB of fp32, twice over while it was
    assigned, in the load's peak)."""
    tied = model.lm_head is None
    linears = (key for key in blocks if key != EMBED and not (tied and key == "lm_head"))
    names = {n for key in linears for n in sources(key, tied, model.spec.arch)}
    if lookup_blocks(model, blocks) is not None:
        names.add(EMBED_NAME)
    return frozenset(names)


def lookup_blocks(model, blocks: dict) -> object | None:
    """The blocks the embedding lookup will read (``block_embedding.BlockEmbedding``) in place of a
    float table, or None where the table must be read: the tied embedding's (the LM head's blocks,
    which it then runs packed) or an untied one's, for an fp32 model on one rank (a 16-bit table
    would be the blocks rounded, which they do not reproduce)."""
    key = "lm_head" if model.lm_head is None else EMBED
    if key not in blocks or model.shard.size != 1 or model.embed.dtype != torch.float32:
        return None
    if blocks[key].fmt in HALF_TYPES:
        return None
    return blocks[key]


# The decoder's fused linears and the weight-map slots whose rows they hold, in order.
LINEAR_SLOTS = {
    "qkv_weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "o_weight": ("o_proj.weight",),
    "gate_up_weight": ("gate_proj.weight", "up_proj.weight"),
    "down_weight": ("down_proj.weight",),
}


def sources(key: str, tied: bool, decl=None) -> list[str]:
    """The checkpoint names whose rows make the linear ``key`` (``linear_weights``), by the
    architecture's weight map (``decl``; default: the Llama family's): one fused tensor, or one
    tensor per slot."""
    if key == "lm_head":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    decl = decl or archs.by_name("LlamaForCausalLM")
    if _expert_of(key) is not None:  # an expert's linear: rows of the GGUF file's stacked tensors
        _, i, _, _, name = key.split(".")
        slots = {"gate_up_weight": ("experts.gate", "experts.up"), "down_weight": ("experts.down",)}[name]
        stacked = {decl.expert_slot(n)[0]: n for n in decl.gguf_names.values() if decl.expert_slot(n)}
        return [f"model.layers.{i}.{stacked[slot]}" for slot in slots if slot in stacked]
    _, i, name = key.split(".")
    names = decl.hf_sources(LINEAR_SLOTS[name])
    if names is None:
        raise ValueError(f"{decl.name}'s weight map has no tensors for {name}")
    return [f"model.layers.{i}.{n}" for n in names]


def _expert_of(key: str) -> int | None:
    """The expert index of a ``linear_weights`` key ``layers.{i}.experts.{e}.{name}``, else None."""
    parts = key.split(".")
    return int(parts[3]) if len(parts) == 5 and parts[2] == "experts" else None


def quantize_linears(model, quantization: str) -> tuple[QuantizedBlocks, str]:
    """Blocks made from the loaded float weights (``int8``: Q8_0, ``int4``: Q4_1) for every linear."""
    fmt = _MADE[quantization]
    for key, param in linear_weights(model).items():
        if param.shape[1] % quant_gemm.QK:
            raise ValueError(
                f"quantization={quantization!r}: {key} has rows of {param.shape[1]}, not a multiple of "
                f"{quant_gemm.QK}"
            )
    made = QuantizedBlocks(
        (key, quant_gemm.quantize_rows(param.data, fmt)) for key, param in linear_weights(model).items()
    )
    return made, f"{len(made)} x {fmt} (made at load from {quantization})"


def resolve_activations(requested: str | None, quantization: str, device) -> str:
    """``int8`` or ``none``: what the quantized linears multiply (``none`` when nothing is quantized).
    An explicit ``int8`` that cannot run is an error naming why; auto falls back with a log line."""
    requested = requested or "auto"
    if requested not in ACTIVATIONS:
        raise ValueError(f"quantized_activations must be one of {ACTIVATIONS}, got {requested!r}")
    if quantization == "none" or requested == "none":
        return "none"
    if requested == "auto" and DEFAULT_ACTIVATIONS == "none":
        return "none"
    reason = quant_int8act.unusable_reason(torch.device(device))
    if reason:
        if requested == "int8":
            raise ValueError(f"quantized_activations='int8' is unavailable: {reason}")
        log.info("quantized linears: fp32 activations (%s)", reason)
        return "none"
    return "int8"


def use_int8_activations(blocks: QuantizedBlocks) -> str:
    """Mark every linear's block set whose format has an int8-activation kernel; the others keep
    fp32 activations. Called at load, before ``prepare_linears``. Returns a summary for the log."""
    made: Counter = Counter()
    kept: Counter = Counter()
    for key, qw in blocks.items():
        if key == EMBED:  # the lookup's, not a linear's
            continue
        if quant_int8act.supports(qw.fmt):
            qw.activations = "int8"
            made[qw.fmt] += 1
        else:
            qw.activations = "fp32"
            kept[qw.fmt] += 1
    summary = f"int8 activations ({quant_int8act.variant()})"
    if kept:
        summary += "; fp32 activations: " + ", ".join(f"{n} x {f}" for f, n in sorted(kept.items()))
    return summary
