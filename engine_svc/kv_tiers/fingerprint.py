"""The fingerprint of an engine's KV bytes: two engines may share stored blocks only when every
input that shapes a block's bytes is the same.

It folds in the model's files (their sizes and a sample of their content: the first and last
MiB and 16 evenly spaced 64 KiB windows of each, so that a 1 GB file is not read whole at every
start), the tokenizer file beside them (a GGUF file carries its own, covered by its sample), the
weights' source and seed (random ``dummy`` weights), the activation dtype, the block size, the
KV layout (each cache tensor's page shape, the layers' windows), the quantization and linear and
kernel choices, the CPU instruction set the native kernels use, the device kind and torch's
version. Any change there is a new fingerprint: old entries are then foreign and never read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

_EDGE = 1 << 20
_WINDOW = 64 << 10
_WINDOWS = 16
_FILES = (
    "*.gguf",
    "*.safetensors",
    "*.bin",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def file_sample(path: Path, h) -> None:
    """Feed ``h`` a file's name, size and sampled content."""
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size <= 2 * _EDGE + _WINDOWS * _WINDOW:
            h.update(f.read())
            return
        h.update(f.read(_EDGE))
        step = (size - 2 * _EDGE) // (_WINDOWS + 1)
        for i in range(1, _WINDOWS + 1):
            f.seek(_EDGE + i * step)
            h.update(f.read(_WINDOW))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))


def model_files(model: str) -> list[Path]:
    """The files whose bytes decide the model's weights and tokenizer."""
    from engine_svc.models.model_path import resolve_model_path

    where = resolve_model_path(model)
    files = [where.gguf] if where.is_gguf else []
    for pattern in _FILES:
        files += [p for p in sorted(where.root.glob(pattern)) if p.suffix != ".gguf"]
    return files


def kv_fingerprint(
    config,
    cache_shapes,
    windows,
    dtype: torch.dtype,
    device: torch.device,
    kernels: str,
    isa: str,
    weights_dtype: torch.dtype | None = None,
) -> bytes:
    """16 bytes naming this engine's KV bytes (``cache_shapes``: each distinct cache tensor's
    shape; ``windows``: per KV cache group, its sliding window; ``dtype``: the cache's,
    ``weights_dtype``: the model's, which may differ: bf16 weights under fp32 activations)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"llmserve-kv-tiers-v1\0")
    if config.load_format == "dummy":
        h.update(f"dummy weights, seed {config.seed}\0".encode())
        from engine_svc.models.model_path import resolve_model_path

        config_json = resolve_model_path(config.model).root / "config.json"
        if config_json.exists():
            file_sample(config_json, h)
    else:
        for path in model_files(config.model):
            file_sample(path, h)
    facts = (
        str(dtype),
        str(weights_dtype),
        str(config.block_size),
        repr([tuple(s) for s in cache_shapes]),
        repr(tuple(windows)),
        repr((config.quantization, config.quantized_activations, config.linear_backend)),
        # bf16 products in the linears: other bits (named only when asked for: the defaults' folders stay)
        *(["linear_dtype=bfloat16"] if config.linear_dtype == "bfloat16" else []),
        kernels,
        isa,
        device.type,
        torch.__version__,
    )
    h.update("\0".join(facts).encode())
    return h.digest()
