"""Repetition (prompt and output tokens), presence and frequency (output tokens), as vLLM/HF do.
The per-row strengths are sampling columns of the batch; the tokens seen are read per step."""

from __future__ import annotations

import torch

from engine_svc import input_batch as ib
from engine_svc.logits_processors.base import LogitsProcessor


def apply_penalties(logits: torch.Tensor, b, output_ids: list[list[int]], prompt_ids: list[list[int]]):
    rows, vocab = logits.shape
    out_counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=logits.device)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
    for r in range(rows):
        if output_ids[r]:
            ids = torch.tensor(output_ids[r], device=logits.device)
            out_counts[r].index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype, device=logits.device))
        if prompt_ids[r]:
            seen[r, torch.tensor(prompt_ids[r], device=logits.device)] = True
    seen |= out_counts > 0
    rep = b.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - b.frequency_penalty[:, None] * out_counts
    logits = logits - b.presence_penalty[:, None] * (out_counts > 0).to(logits.dtype)
    return logits


class Penalties(LogitsProcessor):
    flag = ib.PENALTY
    constraint = False

    def prepare(self, rows, out):
        return [s.output_token_ids for s, *_ in rows], [s.prompt_token_ids for s, *_ in rows]

    def apply(self, logits, state, batch):
        return apply_penalties(logits, batch, *state)
