"""What an embedding request asks of the generation path, and where its vector lands."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmbedSink:
    pooling: str = "last"  # "last" or "mean" (engine_svc/pooling.py)
    normalize: bool = True
    vector: bytes = b""  # float32 little-endian, set when the engine's last delta brings it
    prompt_tokens: int = 0
