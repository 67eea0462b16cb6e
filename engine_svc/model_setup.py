"""Building a rank's model and KV cache: shared by the engine (rank 0) and tensor-parallel workers."""

from __future__ import annotations

import logging
import time

import torch

from engine_svc.config import EngineConfig
from engine_svc.kv_groups import layout_of
from engine_svc.lazy_memory import lazy_zeros, resident_bytes, span
from engine_svc.models.decoder import DecoderForCausalLM
from engine_svc.models.float_weights import Freed, free_layer_weights, free_packed_float_weights
from engine_svc.models.gguf_checkpoint import GGUFCheckpoint, forget_readers
from engine_svc.models.load_result import LoadResult
from engine_svc.models.loader import init_dummy_weights, load_weights
from engine_svc.models.model_path import resolve_model_path
from engine_svc.models.quantized_weights import (
    EMBED_NAME,
    QuantizedBlocks,
    attach_gguf_blocks,
    gguf_blocks,
    linear_weights,
    quantize_linears,
    resolve_activations,
    resolve_quantization,
    served_by_blocks,
    sources,
    use_int8_activations,
)
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.shard import Shard
from kernels.cpu import native_build
from kernels.cpu.features import cpu_features, native_bf16
from kernels.cpu.linear import (
    NATIVE_BF16,
    NATIVE_BF16_DOT,
    NATIVE_F16,
    NATIVE_FP32_BETWEEN,
    linear_products_backend,
    resolve_linear_backend,
)
from kernels.cpu.native_gemm import bf16_dot_path, bf16_path

log = logging.getLogger(__name__)


def load_model(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    shard: Shard,
) -> tuple[DecoderForCausalLM, LoadResult]:
    """The model as loaded, and what the load decided (``LoadResult``)."""
    start = time.perf_counter()
    with torch.device(device):  # build in place: no host copy of a large model
        model = DecoderForCausalLM(spec, dtype, max_model_len, shard)
    where = None if config.load_format == "dummy" else resolve_model_path(config.model)
    is_gguf = where is not None and where.is_gguf
    quant = resolve_quantization(
        config.quantization,
        is_gguf=is_gguf,
        dtype_given=config.dtype is not None,
        device=device,
        tp=shard.size,
    )
    backend = resolve_linear_backend(config.linear_backend, device, dtype)
    # A GGUF file's blocks are read first: the float tensors of the linears they serve packed are
    # then never dequantized (the load's peak memory would otherwise hold the model in fp32).
    found = gguf_blocks(model, where.gguf) if quant == "gguf" else None
    backend = linear_products_backend(
        config.linear_dtype, backend, dtype, blocks=bool(found) or quant in ("int8", "int4")
    )
    unread = served_by_blocks(model, found[0]) if found and backend != "dense" else frozenset()
    if where is None:
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, config.model, unread)
        source = f"GGUF {where.gguf.name}, dequantized" if is_gguf else "safetensors"
        if unread:
            source += f" except the {len(unread)} tensors its blocks serve"
        log.info("weights loaded in %.1fs (%s, to %s)", time.perf_counter() - start, source, dtype)
    blocks, quantized = None, QuantizedBlocks()  # the log's summary; the blocks, by linear
    if found:
        quantized, summary = attach_gguf_blocks(model, found)
        blocks = f"GGUF blocks ({summary})"
        found = None  # ``quantized`` holds them now: the load frees them, then trims the heap
    elif quant in ("int8", "int4"):
        quantized, summary = quantize_linears(model, quant)
        blocks = f"quantized blocks ({summary})"
    activations = resolve_activations(config.quantized_activations, quant, device)
    if blocks and activations == "int8":
        blocks += f", {use_int8_activations(quantized)}"
    elif blocks:
        blocks += ", fp32 activations"
    _log_cpu_dtype(dtype, device, backend)
    done = Freed()  # each layer's float weights go once its linears hold their own copies
    model.prepare_linears(backend, quantized, after_layer=lambda i: free_layer_weights(model, i, done))
    freed, released = free_packed_float_weights(model, quantized, unread, done)
    quantized = None  # the packed linears hold their own form
    _check_unread_freed(model, unread)
    if is_gguf and quant == "gguf":  # the blocks are packed: the file's pages need not stay resident
        GGUFCheckpoint(where.gguf).release_resident_pages()
    if is_gguf:  # the metadata's parsed objects: the model is set up
        forget_readers()
    # What flows between the ops (and what the KV cache and LoRA hold): the weights' dtype, except
    # on the native bf16/fp16 paths, whose linears are packed from the 16-bit weights above and
    # whose activations are fp32: the norms go to fp32 exactly, and the embedding table stays 16-bit
    # (its lookup widens the rows it reads to the model's activation dtype, exactly: no fp32 copy
    # of the vocabulary).
    activation_dtype = dtype
    if backend in NATIVE_FP32_BETWEEN:
        _widen_all_but_the_embedding(model)
        activation_dtype = torch.float32
    model.activation_dtype = activation_dtype  # declared by the model: its lookup reads it
    result = LoadResult(quant, activations, activation_dtype, released)
    isa = native_build.chosen_isa()
    log.info(
        "linear layers: %s%s (%s on %s); %s",
        f"{blocks}, native {'quant_int8act' if activations == 'int8' else 'quant_gemm'} ({isa}); the rest: "
        if blocks and backend != "dense"
        else "",
        {
            "native": f"native GEMM, packed ({isa})",
            NATIVE_BF16: f"native GEMM, bf16 weights packed, fp32 activations ({isa}: {bf16_path(isa)})",
            NATIVE_F16: f"native GEMM, fp16 weights packed, fp32 activations ({isa})",
            NATIVE_BF16_DOT: f"native GEMM, bf16 weights packed, bf16 products ({isa}: {bf16_dot_path(isa)})",
            "onednn": "oneDNN, prepacked",
        }.get(backend, "F.linear"),
        dtype,
        device,
        freed,
    )
    model.finalize()  # the native layer loop's descriptors, over the weights as loaded
    return model, result


def _widen_all_but_the_embedding(model: DecoderForCausalLM) -> None:
    """Every floating parameter and buffer to fp32 (exact from bf16/fp16), except the embedding
    table, which the lookup widens row by row (``DecoderForCausalLM._lookup``)."""
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and p is not model.embed and p.is_floating_point():
                p.data = p.data.float()
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.float()
    model.invalidate()  # storage swapped: the native loop's pointers are rebuilt


def _check_unread_freed(model: DecoderForCausalLM, unread: frozenset[str]) -> None:
    """A parameter the load left unread holds garbage: it must be one that a packed linear made
    redundant and the load freed, never one that something still reads."""
    if not unread:
        return
    for key, param in linear_weights(model).items():
        if param.numel() and unread.intersection(sources(key, model.lm_head is None, model.spec.arch)):
            raise RuntimeError(f"{key}: its float weight was left unread for its blocks, yet is still kept")
    if EMBED_NAME in unread and model.embed.numel():
        raise RuntimeError("the embedding's table was left unread for its blocks, yet is still kept")


def _log_cpu_dtype(dtype: torch.dtype, device: torch.device, backend: str) -> None:
    """One line saying what a CPU dtype runs on: bf16 activations are fast only with AVX-512 BF16
    or AMX; bf16 weights on the native GEMM (fp32 activations) need neither."""
    if device.type != "cpu":
        return
    f = cpu_features()
    isa = f"{f['capability']}, avx512_bf16={f['avx512_bf16']}, amx={f['amx']}"
    if backend in NATIVE_FP32_BETWEEN:
        name = str(dtype).removeprefix("torch.")
        short = {"bfloat16": "bf16", "float16": "fp16"}[name]
        products = ", bf16 products in its GEMMs" if backend == NATIVE_BF16_DOT else ""
        log.info(
            "dtype %s on CPU: %s weights, fp32 activations on the native GEMM%s (%s)",
            name,
            short,
            products,
            isa,
        )
    elif dtype == torch.bfloat16:
        if native_bf16():
            log.info("dtype bfloat16 on CPU: native bf16 matmuls (%s)", isa)
        else:
            log.warning(
                "dtype bfloat16 on CPU without AVX-512 BF16 / AMX (%s): emulated, slower than float32", isa
            )
    else:
        log.info("dtype %s on CPU (%s)", str(dtype).removeprefix("torch."), isa)


KV_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_kv_cache_dtype(
    name: str | None, activation_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype for ``kv_cache_dtype`` ``name``: None/"auto" the activations'; on the CPU
    float32 or bfloat16 whatever the activations (the native attention reads either: a bf16 value
    widened exactly; the torch path widens the blocks it gathers); elsewhere only the activations'
    (the GPU kernels read the cache in the activations' dtype)."""
    if name in (None, "auto"):
        return activation_dtype
    dtype = KV_DTYPE_NAMES[name]
    if device.type != "cpu" and dtype != activation_dtype:
        act = str(activation_dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype={name!r} on {device.type}: the cache there holds the activations' dtype "
            f"({act}); use 'auto' or {act!r}"
        )
    return dtype


def allocate_kv_caches(
    spec: ModelSpec, shard: Shard, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Per layer, its cache ``[2 (k, v), num_blocks, block_size, local kv heads, head_dim]``: one
    tensor per layer, or with sliding-window layers one per slot of a page (``kv_groups.py``),
    which the layers of the same slot in every KV cache group share (a page belongs to one group).

    Zeroed, not empty: padded reads of never-written slots must not bring NaNs into masked math.
    On CPU the slots are views of one lazily backed mapping (``lazy_memory.py``): zero pages that
    become resident only as they are written, so a pool of many GiB costs nothing at start and the
    process's RSS grows with the cache's contents. The storage never moves (kernels keep pointers).
    """
    shape = (2, num_blocks, block_size, shard.kv_heads(spec), spec.head_dim)
    layout = layout_of(spec)
    if device.type == "cpu":
        pool = lazy_zeros((layout.slots, *shape), dtype)
        slots = [pool[j] for j in range(layout.slots)]
    else:
        slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.slots)]
    return [slots[j] for j in layout.layer_slot()]


def kv_resident_bytes(kv_caches: list[torch.Tensor]) -> int:
    """Resident bytes of a CPU KV pool made by ``allocate_kv_caches`` (the pages written so far);
    0 for an empty list."""
    caches = [c for c in kv_caches if c.device.type == "cpu"]
    return resident_bytes(*span(caches)) if caches else 0
