"""``allowed_token_ids``: a row may sample only these."""

from __future__ import annotations

import torch

from engine_svc import input_batch as ib
from engine_svc.logits_processors.base import LogitsProcessor


class AllowedIds(LogitsProcessor):
    flag = ib.LOGIT_CONTROLS
    constraint = True

    def prepare(self, rows, out):
        allowed = [s.params.allowed_token_ids for s, *_ in rows]
        return allowed if any(ids is not None for ids in allowed) else None

    def apply(self, logits, allowed, batch):
        rows = [r for r, ids in enumerate(allowed) if ids is not None]
        keep = torch.full(
            (len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device
        )
        for i, r in enumerate(rows):
            keep[i, torch.tensor(allowed[r], device=logits.device)] = 0.0
        logits[rows] += keep
        return logits
