"""Rotary position embedding, neox layout (rotate the two halves of the head dim), with the
frequency tables of plain, linear-scaled and llama3-scaled RoPE (also as GGUF's per-frequency factors),
and ``none``: a layer without rotary (SmolLM3's NoPE layers), every frequency 0, so its table is
cos 1, sin 0 and the rotation leaves q and k bit for bit.

``rope_table`` builds a layer's whole cos/sin table from its declaration; ``longrope`` (Phi-3's
long-context scaling) is two tables stacked, one per frequency set: a sequence of at most
``original_max_position_embeddings`` tokens is rotated by the short factors, a longer one, whole,
by the long ones, both scaled by ``attention_factor``; ``rotary_rows`` picks a token's row by its
position and its sequence's length.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in fp32, after the scaling named by ``scaling``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "none":  # no rotary: angle 0 at every position
        return torch.zeros_like(inv_freq)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":  # GGUF's form of llama3 scaling: one divisor per frequency
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(
        f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, freq_factors, none"
    )


LONG_ROPE = ("longrope", "su")


def rope_table(head_dim: int, theta: float, scaling: dict | None, max_positions: int) -> torch.Tensor:
    """``[rope_phases(scaling) * max_positions, head_dim]`` cos/sin table of one kind of layer
    (``rope_cos_sin_cache``): one block of ``max_positions`` rows per phase, row ``phase *
    max_positions + position`` (``rotary_rows``).

    ``longrope`` (``scaling`` as ``engine_svc/models/arch/phi3.py`` declares it: ``short_factor``,
    ``long_factor``, ``original_max_position_embeddings``, ``attention_factor``): two phases, as
    HF's Phi-3 rotates a sequence whole by the length it reaches: the short factors at every
    position for a sequence of at most the original length (phase 0), the long factors at every
    position for a longer one (phase 1); both times the attention factor."""
    return torch.cat(rope_rows(head_dim, theta, scaling, 0, max_positions))


def rope_rows(head_dim: int, theta: float, scaling: dict | None, start: int, stop: int) -> list[torch.Tensor]:
    """Rows ``start .. stop`` (positions) of each phase of ``rope_table``'s table, one ``[stop - start,
    head_dim]`` tensor per phase: the same values, bit for bit, as those rows of the whole table
    (each entry is one product ``position * inv_freq`` and its cos or sin, whatever rows are made
    beside it; ``tests/test_rotary_on_demand.py``)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in LONG_ROPE:
        return [rope_cos_sin_rows(rope_inv_freq(head_dim, theta, scaling), start, stop)]
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    scale = float(scaling["attention_factor"])

    def rows(factors) -> torch.Tensor:
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponent)
        return rope_cos_sin_rows(inv_freq, start, stop, scale)

    return [rows(scaling["short_factor"]), rows(scaling["long_factor"])]


def rope_phases(scaling: dict | None) -> int:
    """How many tables ``rope_table`` stacks for this scaling: 2 for long-rope, else 1."""
    return 2 if (scaling or {}).get("rope_type", (scaling or {}).get("type")) in LONG_ROPE else 1


def rotary_rows(positions, lengths, switch: int, max_positions: int):
    """The table rows of tokens at ``positions`` of sequences ``lengths`` long (numpy or torch,
    one entry per token): a sequence longer than ``switch`` reads phase 1's rows."""
    return positions + (lengths > switch) * max_positions


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # is blended smoothly by where the wavelength falls between the two cut-offs.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, scale: float = 1.0) -> torch.Tensor:
    """``[max_positions, head_dim]``: cos of every (position, frequency) pair, then sin."""
    return rope_cos_sin_rows(inv_freq, 0, max_positions, scale)


def rope_cos_sin_rows(inv_freq: torch.Tensor, start: int, stop: int, scale: float = 1.0) -> torch.Tensor:
    """``[stop - start, head_dim]``: ``rope_cos_sin_cache``'s rows of positions ``start .. stop``."""
    freqs = torch.outer(torch.arange(start, stop, dtype=torch.float32), inv_freq.float())
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` by their token's position (neox layout)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(q.dtype)
    sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
