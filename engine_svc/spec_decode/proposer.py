"""Proposers: after a step samples, draft the tokens that may follow, for the next step to verify.

The model runner calls ``propose`` once per step, after sampling, with the step's output, the
sampled tokens and its own record of each sequence (``runner_state.RequestState``, by seq id); the
drafts travel back in the step's result (``StepResult.drafts``), the scheduler's update keeps them
on their sequences (``Sequence.spec_token_ids``, the scheduler's), and the next ``schedule()``
decides whether to verify them (budget, ``max_batch``, the per-sequence cut-off). Nothing flows
backwards: the scheduler never hands out places for a proposer to fill.

``out.propose`` says which sequences (by seq id) draft after this step, and at most how many tokens
(the scheduler's choice: the governor, the cut-off, opted-out requests); a proposer never drafts past
a request's ``max_tokens`` (the last draft's successor is the bonus token). A structured-output
request's n-gram drafts are cut to what its grammar accepts by the scheduler, which owns the grammar.

A proposer's per-sequence state (the n-gram index, how far the draft model's cache holds a
sequence) is its own, keyed by seq id, as vLLM v1's model runner keeps its ``CachedRequestState``:
nothing of it lives on ``Sequence``, which the scheduler owns. It follows the step's KV changes
(``follow``): a forked sequence starts from its parent's state, a released one's is dropped (a
sequence the proposer has not seen starts from nothing)."""

from __future__ import annotations

from typing import Protocol

from engine_svc.input_batch import InputBatch
from engine_svc.runner_state import RequestStates
from engine_svc.sampler import DEAD_END_TOKEN
from engine_svc.scheduler_output import SchedulerOutput
from engine_svc.spec_decode.acceptance import new_tokens
from engine_svc.spec_decode.config import SpeculativeConfig
from engine_svc.spec_decode.ngram import NgramIndex, RecentOutputs


class Proposer(Protocol):
    def propose(
        self, out: SchedulerOutput, token_ids: list[int], states: RequestStates, batch: InputBatch | None
    ) -> dict[int, list[int]]:
        """seq_id -> drafts, for sequences in ``out.propose``; ``token_ids`` are the step's samples,
        in the rows of ``out.rows``; ``states`` the runner's record of each sequence as it stood
        before them; ``batch`` follows this step's block tables."""
        ...

    def follow(self, forks: list[tuple[int, int]], released: list[int]) -> None:
        """The step's KV changes, before ``propose``: (parent, child) seq ids forked since the last
        step, then seq ids that hold no block any more."""
        ...

    def held_ids(self) -> set[int]:
        """Seq ids it keeps state for (checks read it: none may outlive its sequence)."""
        ...


def room(state, num_tokens: int, k: int) -> int:
    """Drafts a sequence of ``num_tokens`` tokens may take: the bonus token after the last draft
    must still fit under its length limit (``state``: its ``RequestState``)."""
    return min(k, state.length_limit - num_tokens - 1)


class NgramProposer:
    """Prompt lookup (spec_decode/ngram.py) over each sequence's tokens as they stand after the step,
    and over the output of a recent sequence of the same tenant whose prompt began as its own
    (``RecentOutputs``: an editor's previous keystroke, an answer asked for again)."""

    def __init__(self, spec: SpeculativeConfig):
        self.lo, self.hi = spec.prompt_lookup_min, spec.prompt_lookup_max
        # seq_id -> its index, once it drafts (a function of its tokens and of the recent outputs
        # when it first drafted: a fork or a re-admission builds its own again).
        self.indexes: dict[int, NgramIndex] = {}
        # seq_id -> (tenant, prompt length, its tokens as it last drafted from them): what goes
        # into ``recent`` when it is released
        self.last: dict[int, tuple[tuple[int, int], int, list[int]]] = {}
        self.recent = RecentOutputs()

    def follow(self, forks: list[tuple[int, int]], released: list[int]) -> None:
        indexes = self.indexes
        for seq_id in released:
            indexes.pop(seq_id, None)
            last = self.last.pop(seq_id, None)
            if last is not None:
                self.recent.add(*last)

    def held_ids(self) -> set[int]:
        return set(self.indexes) | set(self.last)

    def propose(
        self, out: SchedulerOutput, token_ids: list[int], states: RequestStates, batch: InputBatch | None
    ) -> dict[int, list[int]]:
        if not out.propose:
            return {}
        added = new_tokens(out.rows, out.drafts, token_ids)
        drafts = {}
        for seq_id, k in out.propose.items():
            new = added.get(seq_id)
            if not new or new[-1] == DEAD_END_TOKEN:
                continue
            state = states[seq_id]
            tokens = state.token_ids + new
            group = (state.salt, state.lora)
            self.last[seq_id] = (group, state.num_prompt_tokens, tokens)
            k = room(state, len(tokens), k)
            if k <= 0:
                continue
            index = self.indexes.get(seq_id)
            if index is None:
                corpus = self.recent.corpus(group, state.prompt_token_ids)
                index = self.indexes[seq_id] = NgramIndex(self.lo, self.hi, corpus)
            draft = index.propose(tokens, k)
            if draft:
                drafts[seq_id] = draft
        return drafts
