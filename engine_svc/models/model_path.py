"""Where a model's files are: an HF directory (config.json + safetensors) or one GGUF file.

``--model`` may name a ``.gguf`` file, a directory holding exactly one, or an HF directory; every
reader of a model (spec, weights, tokenizer, grammar vocabulary) resolves it here once, so they
cannot disagree about which file is the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelPath:
    root: Path  # the directory the model lives in
    gguf: Path | None  # the GGUF file, or None for an HF directory

    @property
    def is_gguf(self) -> bool:
        return self.gguf is not None

    @property
    def stored_dtype(self) -> str | None:
        """The dtype an HF directory's config names for its weights (``torch_dtype``, or ``dtype`` as
        newer transformers write it), e.g. ``"bfloat16"``; None for a GGUF file or when unnamed."""
        if self.is_gguf:
            return None
        try:
            cfg = json.loads((self.root / "config.json").read_text())
        except (OSError, ValueError):
            return None
        named = cfg.get("torch_dtype") or cfg.get("dtype")
        return named if isinstance(named, str) else None


def resolve_model_path(model: str | Path) -> ModelPath:
    path = Path(model)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a GGUF file or a model directory")
        return ModelPath(path.parent, path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} does not exist")
    if (path / "config.json").exists():
        return ModelPath(path, None)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelPath(path, ggufs[0])
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        raise ValueError(f"model directory {path} holds {len(ggufs)} GGUF files ({names}); name one of them")
    raise FileNotFoundError(f"no config.json or .gguf file in model directory {path}")
