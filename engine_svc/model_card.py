"""What the served model is, as model listings describe it (Ollama's ``details``): its file format,
family, parameter count and size, quantization level and bytes on disk. Read from the files'
metadata only: a GGUF file's header (the reader the loader already opened, cached per process), or
an HF directory's ``config.json`` and its safetensors headers (no weights are read)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from engine_svc.models.model_path import resolve_model_path

# config.json's dtype -> the quantization level a listing names (the weights are not quantized)
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class ModelCard:
    format: str  # "gguf" | "safetensors"
    family: str  # GGUF's general.architecture ("qwen2", "llama", "gemma3"), or HF's model_type
    parameter_count: int
    parameter_size: str  # "1.5B", "135M"
    quantization_level: str  # "Q4_K_M", "Q4_1", "F32", "BF16"; "" when the files do not say
    size_bytes: int


def model_card(model: str | Path) -> ModelCard:
    where = resolve_model_path(model)
    if where.is_gguf:
        return _gguf_card(where.gguf)
    cfg = json.loads((where.root / "config.json").read_text())
    files = sorted(where.root.glob("*.safetensors"))
    count = sum(_safetensors_parameters(f) for f in files)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or ""
    return ModelCard(
        format="safetensors",
        family=str(cfg.get("model_type") or ""),
        parameter_count=count,
        parameter_size=human_size(count),
        quantization_level=_DTYPES.get(str(dtype), str(dtype).upper()),
        size_bytes=sum(f.stat().st_size for f in files),
    )


def _gguf_card(path: Path) -> ModelCard:
    import gguf

    from engine_svc.models.gguf_checkpoint import GGUFCheckpoint

    ck = GGUFCheckpoint(path)
    count = sum(int(t.n_elements) for t in ck.reader.tensors)
    file_type = ck.field("general.file_type")
    try:
        level = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        level = ""
    label = ck.field("general.size_label")
    return ModelCard(
        format="gguf",
        family=str(ck.architecture),
        parameter_count=count,
        parameter_size=str(label) if label else human_size(count),
        quantization_level=level,
        size_bytes=path.stat().st_size,
    )


def _safetensors_parameters(path: Path) -> int:
    """The elements of every tensor a safetensors file holds, from its JSON header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    count = 0
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for d in entry["shape"]:
                n *= d
            count += n
    return count


def human_size(count: int) -> str:
    """A parameter count as listings write it: 1543714304 -> "1.5B", 134515008 -> "134.5M"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            value = count / scale
            text = f"{value:.1f}" if value < 100 or unit == "M" else f"{value:.0f}"
            return text.removesuffix(".0") + unit
    return str(count)
