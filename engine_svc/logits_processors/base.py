"""The logits-processor interface: one logit control per module, applied in one place (``Sampler``).

A processor reads what it needs from the step's sample rows once per step (``prepare``; None when
no row uses it, so a step pays only for the controls its rows use) and changes the logits
(``apply``). Constraints say what a request may sample at all (a grammar's mask, allowed ids, logit
bias): logprobs are reported after them, and a row they leave without any token is a dead end.
Adjustments (min_tokens, bad words, penalties) come after the logprobs are read, as vLLM does.
A new control is one new module here and one entry in ``processors.default_processors``."""

from __future__ import annotations

from typing import Any

import torch

# (the runner's RequestState of its sequence, index of the noise it draws, position offset) per
# sample row: model_runner._row_states.
SampleRow = tuple[Any, int, int]


class LogitsProcessor:
    flag: int  # the input-batch flag (engine_svc/input_batch.py) of the rows that may use it
    constraint: bool  # True: before logprobs and the dead-end check; False: after them

    def prepare(self, rows: list[SampleRow], out) -> object | None:
        """This step's per-row state (``out``: the step's ``SchedulerOutput``), or None when no row
        uses the control."""
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, state, batch) -> torch.Tensor:
        """The changed logits (in place where it can; the returned tensor is what counts)."""
        raise NotImplementedError


def ban(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """Per row, the ids it may not sample now set to -inf."""
    for r, ids in enumerate(banned):
        if ids:
            logits[r, ids] = float("-inf")
    return logits
