"""``logit_bias``: per token id, a value added to its logit."""

from __future__ import annotations

import torch

from engine_svc import input_batch as ib
from engine_svc.logits_processors.base import LogitsProcessor


class LogitBias(LogitsProcessor):
    flag = ib.LOGIT_CONTROLS
    constraint = True

    def prepare(self, rows, out):
        biases = [s.params.logit_bias for s, *_ in rows]
        return biases if any(biases) else None

    def apply(self, logits, biases, batch):
        for r, bias in enumerate(biases):
            if bias:
                ids = torch.tensor(list(bias), device=logits.device)
                logits[r, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        return logits
