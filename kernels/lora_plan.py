"""Once per step, the plan of a mixed-adapter LoRA batch: the tokens that use an adapter, ordered
by slot, one segment per slot. Every LoRA kernel (torch twin, Triton) reads it; the engine builds
it (``engine_svc/lora/batch.py``) without depending on any one implementation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Segment:
    slot: int
    start: int  # rows [start, end) of the gathered (slot-ordered) tokens
    end: int


@dataclass(frozen=True)
class TokenPlan:
    rows: slice | torch.Tensor  # the adapter tokens, in slot order (a slice when already so)
    count: int
    segments: tuple[Segment, ...]


def plan_tokens(token_slots: np.ndarray, device: torch.device | str = "cpu") -> TokenPlan:
    """``token_slots``: one slot per token (-1 = base)."""
    order = np.argsort(token_slots, kind="stable")
    order = order[token_slots[order] >= 0]
    slots = token_slots[order]
    if not len(order):
        return TokenPlan(slice(0, 0), 0, ())
    bounds = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(order)]])
    segments = tuple(Segment(int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True))
    if len(order) and order[-1] - order[0] + 1 == len(order) and np.all(np.diff(order) == 1):
        rows: slice | torch.Tensor = slice(int(order[0]), int(order[-1]) + 1)
    else:
        rows = torch.from_numpy(order).to(device)
    return TokenPlan(rows, len(order), segments)
