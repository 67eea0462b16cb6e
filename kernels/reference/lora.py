"""Batched mixed-adapter LoRA, the torch twin: every token's row goes through its own adapter's A
and B, read from stacks of adapter slots.

    out[t] += (x[t] @ A[s].T) @ B[s].T      for each token t whose slot s = token_slots[t] >= 0

Once per step the tokens are planned (``plan_tokens``): the rows that use an adapter, ordered by
slot, and one segment per slot. Per projection, those rows are gathered once, each segment is two
matmuls (one pair of GEMMs per adapter in the step, never a Python loop per token), and the deltas
are added back in one scatter. Base tokens (slot -1) are not touched; when every token uses an
adapter and they are already grouped, there is no gather or scatter at all."""

from __future__ import annotations

import torch

from kernels.lora_plan import TokenPlan


def lora_apply(
    out: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    plan: TokenPlan,
    max_rank: int,
) -> None:
    """Add each token's LoRA delta to ``out [T, n]`` in place (``out`` may be a column slice of a
    fused projection's output). ``a_stack [S, R, in]``, ``b_stack [S, n, R]``; ``token_slots`` is
    the Triton kernel's input and unused here (``plan`` says the same, grouped); columns of the
    stacks past ``max_rank`` are not read."""
    del token_slots
    if not plan.count:
        return
    xs = x[plan.rows]
    delta = xs.new_empty(plan.count, out.shape[1])
    for seg in plan.segments:
        part = xs[seg.start : seg.end]
        shrunk = part @ a_stack[seg.slot, :max_rank].T
        torch.mm(shrunk, b_stack[seg.slot, :, :max_rank].T, out=delta[seg.start : seg.end])
    if isinstance(plan.rows, slice):
        out[plan.rows] += delta
    else:
        out.index_add_(0, plan.rows, delta)
