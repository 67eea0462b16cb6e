"""The scheduler's side of the wire to the runner: a planned step (``ScheduledStep``, over live
``Sequence`` objects) and the KV changes since the last step become the plain-data
``SchedulerOutput`` the runner reads.

The builder remembers what the runner holds of each sequence (how many of its tokens it was sent),
so that a sequence goes out whole once (``NewRequestData``: the first step it is scheduled in, or
again after the runner forgot it: a release) and as deltas afterwards (the tokens appended since,
its counter; in the steady state - the same sequences decoding step after step - the one token
each appended, flat, as the scheduler's update hands them over: ``CachedRequestData.one_each``).
Block-table changes go out for sequences the runner held before the step; a new one
carries its whole tables. A structured-output row's allowed-token mask is filled here, from its
grammar's state, which nothing changes between planning and sampling.
"""

from __future__ import annotations

from engine_svc.block_hash import salt_hash
from engine_svc.kv_cache_manager import KVCacheManager, StepChanges
from engine_svc.logits_processors.grammar import fill_grammar_bitmask
from engine_svc.scheduled_step import ScheduledStep
from engine_svc.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    PromptRows,
    SchedulerOutput,
    StepRows,
)
from engine_svc.sequence import Sequence


class OutputBuilder:
    def __init__(self, kv: KVCacheManager, vocab_size: int | None = None, grammar_executor=None):
        """``vocab_size``: the logits' width (a grammar's mask covers it; None: no grammars)."""
        self.kv = kv
        self.vocab_size = vocab_size
        self.grammar_executor = grammar_executor  # llguidance.LLExecutor (None: made on first need)
        # seq id -> tokens of it the runner holds (the runner holds exactly these ids; during a steady
        # run its sequences' counts lag by the run's length, counted in when it ends: _steady)
        self.sent: dict[int, int] = {}
        self.finished: list[str] = []  # request ids that ended since the last step
        # The last step's update, when it was all decodes and every sequence lived on: its
        # sequences, their ids and the one token each appended (``appended``); cleared by the
        # next build.
        self._appended: tuple[list[Sequence], list[int], list[int]] | None = None
        # A run of steady builds (``one_each`` deltas) not yet counted in ``sent``: their seq ids
        # and how many builds sent each of them one token more.
        self._steady: list | None = None

    def request_ended(self, request_id: str) -> None:
        self.finished.append(request_id)

    def appended(self, step: ScheduledStep, tokens: list[int]) -> None:
        """The scheduler's update of an all-decode step that ended no sequence: its sequence
        ``step.seqs[i]`` appended exactly ``tokens[i]``. If the next step schedules the same
        sequences in the same order, these are its deltas, with no per-sequence work."""
        self._appended = (step.seqs, step.output.seq_ids, tokens)

    def _settle_steady(self) -> None:
        """Count a run of steady builds into ``sent``."""
        ids, k = self._steady
        self._steady = None
        sent = self.sent
        for seq_id in ids:
            if seq_id in sent:
                sent[seq_id] += k

    def build(self, step: ScheduledStep, changes: StepChanges) -> SchedulerOutput:
        sent = self.sent
        appended, self._appended = self._appended, None
        seqs = step.seqs
        if (
            appended is not None
            and step.only_decodes
            and not changes.released
            and appended[0] == seqs  # the same sequences (compared by identity first), in order
            and (self._steady is None or self._steady[0] is appended[1])
        ):
            # The steady state: the runner holds each of them up to the token it sampled last step.
            seq_ids = appended[1]
            cached = CachedRequestData(
                seq_ids, None, [s.num_computed_tokens for s in seqs], one_each=list(appended[2])
            )
            if self._steady is None:
                self._steady = [seq_ids, 1]
            else:
                self._steady[1] += 1
            updates = changes.updates
            if updates and any(u.seq_id not in sent for u in updates):
                updates = [u for u in updates if u.seq_id in sent]
            return self._finish(step, changes, seq_ids, [], cached, updates)
        seq_ids = [s.seq_id for s in seqs]
        if self._steady is not None:
            self._settle_steady()
        for seq_id in changes.released:
            sent.pop(seq_id, None)
        held = list(map(sent.get, seq_ids))  # tokens of each the runner holds (None: not held)
        new: list[NewRequestData] = []
        if None not in held:  # the runner holds every one: deltas only, one pass each
            tokens = [s.token_ids for s in seqs]
            cached = CachedRequestData(
                seq_ids,
                [t[h:] for t, h in zip(tokens, held, strict=True)],
                [s.num_computed_tokens for s in seqs],
            )
            sent.update(zip(seq_ids, map(len, tokens), strict=True))
        else:
            cached = CachedRequestData()
            c_ids, c_tokens, c_computed = cached.seq_ids, cached.new_token_ids, cached.num_computed_tokens
            for seq, h in zip(seqs, held, strict=True):
                tokens = seq.token_ids
                if h is None:
                    new.append(self._new(seq))
                else:
                    c_ids.append(seq.seq_id)
                    c_tokens.append(tokens[h:])
                    c_computed.append(seq.num_computed_tokens)
                sent[seq.seq_id] = len(tokens)
        updates = changes.updates
        if updates and (new or any(u.seq_id not in sent for u in updates)):
            fresh = {r.seq_id for r in new}  # their whole tables travel with them
            updates = [u for u in updates if u.seq_id in sent and u.seq_id not in fresh]
        return self._finish(step, changes, seq_ids, new, cached, updates)

    def _finish(self, step, changes, seq_ids, new, cached, updates) -> SchedulerOutput:
        layout = step.layout
        if step.only_decodes:
            rows = StepRows(layout.token_rows, seq_ids, layout.fans, layout.num_sample_rows)
        else:
            rows = StepRows(
                layout.token_rows,
                [s.seq_id for s in layout.sampled],
                layout.fans,
                layout.num_sample_rows,
                [PromptRows(c.seq.seq_id, c.first, c.count, c.row) for c in layout.prompt_chunks],
                layout.drafts,
            )
        out = SchedulerOutput(
            seq_ids=seq_ids,
            num_scheduled=step.num_new,
            new=new,
            cached=cached,
            only_decodes=step.only_decodes,
            rows=rows,
            updates=updates,
            released=changes.released,
            copies=changes.copies,
            tier_ops=changes.tier_ops,
        )
        if step.drafts:
            out.drafts = {s.seq_id: d for s, d in step.drafts.items()}
        if step.propose:
            out.propose = {s.seq_id: k for s, k in step.propose.items()}
        if changes.forks:
            out.forks = changes.forks
        if self.finished:
            out.finished_requests, self.finished = self.finished, []
        matchers = [s.matcher for s in layout.sampled]
        if matchers.count(None) != len(matchers):
            self._grammar(out, layout, matchers)
        return out

    def _new(self, seq: Sequence) -> NewRequestData:
        request, kv = seq.request, self.kv
        return NewRequestData(
            seq_id=seq.seq_id,
            request_id=request.request_id,
            index=seq.index,
            token_ids=list(seq.token_ids),  # the runner's own copy: it appends the deltas to it
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=seq.num_computed_tokens,
            length_limit=request.length_limit,
            params=request.params,
            block_ids=[list(kv.block_table(seq, g)) for g in range(len(kv.group_tables))],
            lora=request.lora.version if request.lora is not None else 0,
            salt=salt_hash(request.cache_salt) >> 1,  # (63 bits: the wire's integers are signed)
        )

    def _grammar(self, out: SchedulerOutput, layout, matchers: list) -> None:
        """Each sample row's matcher (a completing ``n > 1`` prompt's rows share one), and for a
        sequence verifying drafts, the drafts its rows after the first are masked through."""
        per_row, drafts = [], {}
        draft_of = layout.drafts or [None] * len(matchers)
        for matcher, fan, draft in zip(matchers, layout.fans, draft_of, strict=True):
            if draft is not None and matcher is not None:
                drafts[len(per_row)] = draft
            per_row += [matcher] * fan
        if self.vocab_size is None:
            raise ValueError("a structured-output request needs the scheduler's vocab_size")
        if self.grammar_executor is None:
            import llguidance

            self.grammar_executor = llguidance.LLExecutor()
        out.grammar_rows, out.grammar_bitmask = fill_grammar_bitmask(
            per_row, self.grammar_executor, self.vocab_size, drafts
        )
