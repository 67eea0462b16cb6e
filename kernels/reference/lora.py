"""Batched mixed-adapter LoRA, the torch twin: every token's row goes through its own adapter's A
and B, read from stacks of adapter slots.

    out[t] += (x[t] @ A[s].T) @ B[s].T      for each token t whose slot s = token_slots[t] >= 0

Tokens are grouped by adapter once per step (``group_tokens``); each group is two matmuls over its
rows (a slice when its tokens are contiguous, an index otherwise), so the cost is one pair of GEMMs
per adapter in the step, never a Python loop per token. Base tokens (slot -1) are not touched."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TokenGroup:
    slot: int
    rank: int  # the adapter's rank: columns past it in the padded stacks are zero and skipped
    rows: slice | torch.Tensor  # the group's token rows


def group_tokens(
    token_slots: np.ndarray, ranks: dict[int, int], device: torch.device | str = "cpu"
) -> list[TokenGroup]:
    """One group per slot in ``token_slots`` (int array, -1 = base), in slot order."""
    groups = []
    for slot in np.unique(token_slots):
        if slot < 0:
            continue
        rows = np.flatnonzero(token_slots == slot)
        if rows[-1] - rows[0] + 1 == len(rows):
            index: slice | torch.Tensor = slice(int(rows[0]), int(rows[-1]) + 1)
        else:
            index = torch.from_numpy(rows).to(device)
        groups.append(TokenGroup(int(slot), ranks[int(slot)], index))
    return groups


def lora_apply(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    groups: list[TokenGroup],
    max_rank: int,
) -> None:
    """Add each token's LoRA delta to ``out [T, n]`` in place (``out`` may be a column slice of a
    fused projection's output). ``a_stack [S, R, in]``, ``b_stack [S, n, R]``; ``token_slots`` is
    the Triton kernel's input and unused here (``groups`` say the same, grouped)."""
    del token_slots, max_rank
    for g in groups:
        xs = x[g.rows]
        delta = (xs @ a_stack[g.slot, : g.rank].T) @ b_stack[g.slot, :, : g.rank].T
        out[g.rows] += delta
