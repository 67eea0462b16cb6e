"""Proposers: after a step samples, draft the tokens that may follow, for the next step to verify.

The model runner calls ``propose`` once per step, after sampling, with the schedule and the sampled
tokens; the drafts travel back in the step's result (``StepResult.drafts``), the scheduler's update
keeps them on their sequences (``Sequence.spec_token_ids``, the scheduler's), and the next
``schedule()`` decides whether to verify them (budget, ``max_batch``, the per-sequence cut-off).
Nothing flows backwards: the scheduler never hands out places for a proposer to fill.

``out.propose`` says which sequences draft after this step, and at most how many tokens (the
scheduler's choice: the governor, the cut-off, opted-out requests); a proposer never drafts past a
request's ``max_tokens`` (the last draft's successor is the bonus token).

A proposer's per-sequence state (the n-gram index, how far the draft model's cache holds a
sequence) is its own, keyed by seq id, as vLLM v1's model runner keeps its ``CachedRequestState``:
nothing of it lives on ``Sequence``, which the scheduler owns. It follows the step's KV changes
(``follow``): a forked sequence starts from its parent's state, a released one's is dropped (a
sequence the proposer has not seen starts from nothing)."""

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

    def follow(self, forks: list[tuple[int, int]], released: list[int]) -> None:
        """The step's KV changes, before ``propose``: (parent, child) seq ids forked since the last
        step, then seq ids that hold no block any more."""
        ...

    def held_ids(self) -> set[int]:
        """Seq ids it keeps state for (checks read it: none may outlive its sequence)."""
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
        # seq_id -> its index, once it drafts (a pure function of its tokens: a fork or a
        # re-admission builds its own again, with the same proposals).
        self.indexes: dict[int, NgramIndex] = {}

    def follow(self, forks: list[tuple[int, int]], released: list[int]) -> None:
        indexes = self.indexes
        for seq_id in released:
            indexes.pop(seq_id, None)

    def held_ids(self) -> set[int]:
        return set(self.indexes)

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
            index = self.indexes.get(seq.seq_id)
            if index is None:
                index = self.indexes[seq.seq_id] = NgramIndex(self.lo, self.hi)
            draft = index.propose(tokens, k)
            if draft and seq.matcher is not None:  # its matcher has not consumed ``new`` yet
                draft = draft[: max(0, seq.matcher.validate_tokens(new + draft) - len(new))]
            if draft:
                drafts[seq.seq_id] = draft
        return drafts
