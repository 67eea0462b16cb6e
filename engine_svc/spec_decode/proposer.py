"""Proposers: after a step samples, draft the tokens that may follow, for the next step to verify.

The model runner calls ``propose`` once per step, after sampling, with the schedule and the sampled
tokens; the drafts travel back in the step's result (``StepResult.drafts``), the scheduler's update
keeps them on their sequences (``Sequence.spec_token_ids``), and the next ``schedule()`` decides
whether to verify them (budget, ``max_batch``, the per-sequence cut-off). Nothing flows backwards:
the scheduler never hands out places for a proposer to fill.

``out.propose`` says which sequences draft after this step, and at most how many tokens (the
scheduler's choice: the governor, the cut-off, opted-out requests); a proposer never drafts past a
request's ``max_tokens`` (the last draft's successor is the bonus token)."""

from __future__ import annotations

from typing import Protocol

from engine_svc.input_batch import InputBatch
from engine_svc.sampler import DEAD_END_TOKEN
from engine_svc.scheduler_output import SchedulerOutput
from engine_svc.spec_decode.acceptance import new_tokens
from engine_svc.spec_decode.config import SpeculativeConfig
from engine_svc.spec_decode.ngram import NgramIndex


class Proposer(Protocol):
    def propose(self, out: SchedulerOutput, token_ids: list[int], batch: InputBatch) -> dict[int, list[int]]:
        """seq_id -> drafts, for sequences in ``out.propose``; ``token_ids`` are the step's samples,
        in the rows of ``out.layout``; ``batch`` follows this step's block tables."""
        ...


def room(seq, num_tokens: int, k: int) -> int:
    """Drafts a sequence of ``num_tokens`` tokens may take: the bonus token after the last draft
    must still fit under its length limit."""
    return min(k, seq.request.length_limit - num_tokens - 1)


class NgramProposer:
    """Prompt lookup (spec_decode/ngram.py) over each sequence's tokens as they stand after the step.
    A structured-output request's drafts are cut to what its grammar accepts after those tokens:
    only they are worth verifying."""

    def __init__(self, spec: SpeculativeConfig):
        self.lo, self.hi = spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, out: SchedulerOutput, token_ids: list[int], batch: InputBatch) -> dict[int, list[int]]:
        if not out.propose:
            return {}
        added = new_tokens(out.layout, out.drafts, token_ids)
        drafts = {}
        for seq, k in out.propose.items():
            new = added.get(seq)
            if not new or new[-1] == DEAD_END_TOKEN:
                continue
            tokens = seq.token_ids + new
            k = room(seq, len(tokens), k)
            if k <= 0:
                continue
            if seq.ngram is None:
                seq.ngram = NgramIndex(self.lo, self.hi)
            draft = seq.ngram.propose(tokens, k)
            if draft and seq.matcher is not None:  # its matcher has not consumed ``new`` yet
                draft = draft[: max(0, seq.matcher.validate_tokens(new + draft) - len(new))]
            if draft:
                drafts[seq.seq_id] = draft
        return drafts
