"""Embeddings from the served decoder model, as vLLM's pooling runner makes them for decoder models:
the final hidden state after the final norm, pooled over one request's prompt ("last": its last
token's row; "mean": the mean of every prompt token's row), L2-normalised unless asked not to be.

An embedding request is an ordinary request with ``params.pooling`` set (and ``max_tokens`` 1, which
it never uses): it runs its prompt (in chunks, after a prefix-cache hit, recomputed after a
preemption, like any other), but the step that ends its prompt gives it no logits row and samples
nothing: the scheduler's update finishes it there with its vector on a delta that holds no token.

Bitwise: a row's hidden state has the same bits whatever shares its step and however the prompt
was chunked (the CPU kernels' contract, docs/design/batch-invariance.md), and each vector is
reduced and normalised on its own, so a vector is the same alone or in any batch. "last" works
with prefix caching (the engine always computes a prompt's last token); "mean" needs every
prompt row computed, so the engine gives such a request a salt of its own (no hit on another
request's blocks; a hit on its own, after a preemption, covers rows it has already kept).
"""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.runner_state import RequestState


class PoolingPlan:
    """Which rows of a step's flat batch each embedding request needs (None when none is there)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        # (its sequence's RequestState, first row, count, prompt ends)
        self.parts: list[tuple[RequestState, int, int, bool]] = []

    @classmethod
    def of(cls, states: list[RequestState], num_new: list[int]) -> PoolingPlan | None:
        plan = None
        start = 0
        for seq, n in zip(states, num_new, strict=True):
            params = seq.params
            if params.pooling is not None:
                c = seq.num_computed_tokens
                ends = c + n == seq.num_prompt_tokens
                if params.pooling == "mean" or ends:
                    plan = plan or cls()
                    first = start if params.pooling == "mean" else start + n - 1
                    count = n if params.pooling == "mean" else 1
                    plan.parts.append((seq, len(plan.rows), count, ends))
                    plan.rows.extend(range(first, first + count))
            start += n
        return plan

    def finish(self, hidden: torch.Tensor, kept: dict[str, torch.Tensor]) -> dict[str, bytes]:
        """``hidden``: the plan's rows, in order; ``kept``: the runner's "mean" rows so far, by
        request id (kept across a preemption; the runner drops a request's when it ends). Returns
        the vectors of the prompts that ended."""
        hidden = hidden.float().cpu()
        out = {}
        for seq, row, count, ends in self.parts:
            params, rows = seq.params, hidden[row : row + count]
            if params.pooling == "mean":
                # By position: a chunk computed again (after a preemption) writes the same bits again.
                pooled = kept.get(seq.request_id)
                if pooled is None:
                    pooled = kept[seq.request_id] = torch.empty(seq.num_prompt_tokens, rows.shape[1])
                c = seq.num_computed_tokens
                pooled[c : c + count] = rows
                if not ends:
                    continue
                vector = pooled.mean(dim=0)
                del kept[seq.request_id]
            else:
                vector = rows[0].clone()
            if params.normalize:
                vector = vector / torch.linalg.vector_norm(vector).clamp_min(1e-12)
            out[seq.request_id] = vector.numpy().astype("<f4").tobytes()
        return out


def decode_vector(data: bytes) -> np.ndarray:
    """A delta's embedding bytes as a float32 array."""
    return np.frombuffer(data, dtype="<f4")
