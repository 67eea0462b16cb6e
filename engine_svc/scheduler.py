"""The scheduler decides what each step computes, and applies what it produced.

``schedule()``: how many tokens each sequence computes, under a global token budget and a work
budget (``step_cost.py``: a token's attention work grows with its context, so a chunk deep in a
long prompt gets fewer tokens). Running sequences are served first (so streams that already
decode are never starved by a long prompt), then waiting ones are admitted. A prompt longer than
the remaining budget is cut into chunks (chunked prefill). When the pool runs dry, a paused
sequence, else the most recently admitted running one (or the lowest-priority one), is preempted:
its blocks are released and it goes back to the front of the waiting queue, to be recomputed
later (cheaply, from the prefix cache).

When more sequences may run than a step computes (``max_seqs_per_step``), the step's seats go
round the clients that sent them, running and waiting sequences alike (``_seats``): a stream is
never slowed, nor a request kept waiting, by another client's hundreds of streams beyond one seat
per client per round.

``update_from_output()``: everything that follows a forward pass — advance the counters, publish
full blocks to the prefix cache, record prompt logprobs, append sampled tokens, fork ``n > 1``
requests, apply the one stop rule, free what finished, keep the proposer's drafts on their sequences
for the next ``schedule()`` to verify — and the deltas to send. Nothing else touches the queues, so
the scheduler can be driven by fake step results in tests, with no model at all.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from engine_svc.config import EngineConfig
from engine_svc.kv_cache_manager import KVCacheManager, cdiv
from engine_svc.logits_layout import LogitsLayout, StepResult
from engine_svc.output_builder import OutputBuilder
from engine_svc.outputs import RequestDelta
from engine_svc.request_queue import make_queue
from engine_svc.request_queue import priority_key as _priority_key
from engine_svc.sampler import DEAD_END_TOKEN
from engine_svc.scheduled_step import ScheduledStep
from engine_svc.sequence import FinishReason, Request, SeqStatus, Sequence
from engine_svc.spec_decode.acceptance import num_accepted
from engine_svc.spec_decode.config import SpeculativeConfig
from engine_svc.spec_decode.governor import SpeculationGovernor
from engine_svc.step_cost import STEP_FLOOR, FloorFit, StepCost, decode_cap

log = logging.getLogger(__name__)

DEAD_END = "no token the request may sample satisfies its constraints"


def dead_end_error(params) -> str:
    """Why a request ended without a token: ``DEAD_END``, naming the controls it uses (together
    they left its next token nothing)."""
    used = [
        name
        for name, on in (
            ("structured_outputs", params.structured_outputs is not None),
            ("allowed_token_ids", params.allowed_token_ids is not None),
            ("logit_bias", bool(params.logit_bias)),
            ("bad_words", bool(params.bad_words_token_ids)),
            (f"min_tokens={params.min_tokens}", params.min_tokens > 0),
        )
        if on
    ]
    return f"{DEAD_END} ({', '.join(used)} left its next token none)" if used else DEAD_END


class Speculation(NamedTuple):
    """The speculative part of a running sequence's plan for a step."""

    draft: list[int] | None  # the drafts it verifies (None: none)
    after: int  # drafts the proposer may make after the step (0: none)
    tokens: int  # the tokens it computes with them (1 + len(draft) when it verifies)
    lookahead: int  # slots past those for a draft model's next drafts


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        speculative: SpeculativeConfig | None = None,
        attention_work_ratio: float | None = None,
        max_per_step: int | None = None,
        decode_stall: tuple[float, float] | None = None,
        measure_floor: bool = False,
        vocab_size: int | None = None,
        grammar_executor=None,
    ):
        """``decode_stall``: (factor, floor) of ``step_cost.decode_cap``, the engine's for its
        device (None: the config's factor with the CPU floor; a factor of 0 or None: no cap).
        ``measure_floor``: the floor is then measured from the step times the engine notes
        (``step_cost.FloorFit``), ``floor`` until it can be."""
        """``speculative``: the engine's parsed ``config.speculative_config`` (None: no drafts).
        ``vocab_size`` and ``grammar_executor``: what a structured-output row's mask is filled with
        (``output_builder.OutputBuilder``)."""
        self.config = config
        self.kv = kv
        # The step's work budget (step_cost.py): the engine passes the model's ratio; without one
        # (model-free tests) the config's, and 0 (tokens alone) when that is unset too.
        ratio = config.attention_work_ratio if attention_work_ratio is None else attention_work_ratio
        self.cost = StepCost(config.max_num_batched_tokens, ratio or 0.0)
        if decode_stall is None:
            decode_stall = (config.decode_stall_factor or 0.0, STEP_FLOOR["cpu"])
        self.stall_factor, self.step_floor = decode_stall
        # The fixed cost measured from step times (None: the floor as given, e.g. model-free tests).
        self.floor_fit = FloorFit() if measure_floor and self.stall_factor else None
        self._planned_work = 0.0  # of the step just planned: its work, for floor_fit
        self._capped = False  # of the step being planned: its work bounded by decodes in it
        self._work = 0.0  # of the step being planned: work left in its budget
        self._work_start = 0.0  # of the step being planned: its budget (the cap, once it applies)
        # Of the step being planned, until its decode cap is settled (``_settle_cap``): the
        # running sequences that sit it out (None: settled, or no cap at all).
        self._cap_sitting_out: set[Sequence] | None = None
        self._prefilled = False  # of the step being planned: whether a prompt chunk is in it
        self.waiting = make_queue(config.scheduling_policy)  # paused requests' sequences held aside
        # Seats of a step (the engine resolves the device's default; model-free tests: the config's).
        self.max_per_step = max_per_step or config.max_seqs_per_step or config.max_num_seqs
        self.num_steps = 0  # steps planned: a sequence's last_step is one of these
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_rope_recomputes = 0  # sequences computed anew past a long-rope switch
        # Admissions put off because a running sequence was computing the blocks they would compute.
        self.num_held = 0
        self.priority = config.scheduling_policy == "priority"
        self.spec = speculative
        self.draft_model = self.spec is not None and self.spec.method == "draft_model"
        self.governor = SpeculationGovernor() if self.spec is not None and self.spec.adaptive else None
        # Slots past a step's tokens that its proposer writes K/V into (a draft model drafts there,
        # n-gram lookup writes nothing): allocated with the step, like vLLM's lookahead tokens.
        self.num_lookahead = self.spec.num_speculative_tokens if self.draft_model else 0
        self.num_drafted = self.num_accepted = 0
        # Distinct LoRA adapters the running sequences may use: one device slot each.
        self.max_loras = config.max_loras if config.enable_lora else 0
        # Builds each step's plain-data output for the runner, and remembers what the runner holds.
        self.output_builder = OutputBuilder(kv, vocab_size, grammar_executor)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.push(seq)

    def set_paused(self, request: Request, paused: bool) -> None:
        """A paused request takes no steps: the queue holds its waiting sequences, and its running
        ones are skipped (their blocks are the first to go when the pool runs dry)."""
        request.paused = paused
        (self.waiting.pause if paused else self.waiting.resume)(request)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it and release its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.discard(seq)
        if seq.request.finished:
            self.waiting.forget(seq.request)
            self.output_builder.request_ended(seq.request.request_id)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        """Its blocks go back to the pool; what it had computed is gone with them (and its drafts,
        whose K/V a draft model wrote in those blocks)."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []

    def abort(self, request: Request, indexes) -> None:
        """End outputs ``indexes`` of ``request`` (no delta). Before an ``n > 1`` request forks, its
        sequence 0 carries the prompt for every index: it keeps running while any index is owed."""
        request.ended.update(indexes)
        if request.forked:
            for seq in request.sequences:
                if seq.index in indexes:
                    self._finish(seq, FinishReason.ABORT)
        elif request.finished:
            self._finish(request.sequences[0], FinishReason.ABORT)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            seq.request.ended.add(seq.index)
            self.remove(seq)

    # --- planning a step ------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        """Each sequence in turn (running ones first, then admissions): plan its share of the step
        from its state and what is left of the budgets (tokens, drafts to verify, lookahead slots
        for drafting after it), take the plan's blocks in one allocation (``_take_slots``; on a dry
        pool, the plan without its speculation, then preemptions), and commit it to the output.
        The step's flags (``only_decodes``, ``all_decoding``) are derived from what was committed."""
        out = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        self._work, self._prefilled = self.cost.budget, False
        cost = self.cost.chunk if self.cost.ratio else None
        i = 0
        others = 0  # committed sequences that do not just decode (prompt chunks, admissions)
        # The loop below runs once per running sequence per step: locals, not attribute lookups.
        running, take_slots = self.running, self._take_slots
        add_seq, add_num = out.seqs.append, out.num_new.append
        out.num_running = len(running)
        # Drafts proposed after the last step are verified while the batch is small enough; whether
        # to draft after this one is the governor's call (so that its exploring steps draft, and
        # the next verifies).
        verify = self.spec is not None and len(running) <= self.spec.max_batch
        propose = verify and (self.governor is None or self.governor.allow(len(running)))
        # A sequence on a streak (every draft of its last verification accepted, or none verified
        # yet) drafts again whatever the governor's average says, where a step whose drafts are all
        # accepted is measured cheaper per token than a plain one.
        streak = verify and (
            self.governor is None
            or self.governor.full_drafts_pay(len(running), self.spec.num_speculative_tokens + 1)
        )
        self.num_steps += 1
        out_this_step, seated_waiting = self._seats()
        switch = self.kv.rope_switch is not None  # long-rope: a sequence past it is computed anew
        # The decode cap (``_decode_cap``) bounds only prompt chunks' work, so it is settled when the
        # first chunk is fitted (or before a preemption changes the running set it reads): a step of
        # decodes alone, the steady state, never pays for the pass over the running sequences.
        self._capped, self._work_start = False, self._work
        self._cap_sitting_out = out_this_step if self.stall_factor else None
        while i < len(running) and budget > 0:
            seq = running[i]
            request = seq.request
            if request.paused or (out_this_step and seq in out_this_step):
                i += 1
                continue
            if switch and self.kv.needs_recompute(seq):
                self._settle_cap(out)  # before the running set changes
                self._recompute(seq, out)  # (it leaves ``running``: the next one is at i now)
                continue
            # The plan: its tokens, and with speculation the drafts it verifies, the drafts the
            # proposer may make after it and the lookahead slots they need (None: none).
            num_tokens = len(seq.token_ids)
            remaining = num_tokens - seq.num_computed_tokens
            num_new = remaining if remaining < budget else budget
            decoding = remaining == 1 and num_tokens != request.num_prompt_tokens
            if not decoding and remaining > 1 and self.config.enable_chunked_prefill:
                num_new = self._fit(out, seq.num_computed_tokens, num_new)
                if num_new == 0:  # no work left this step for the rest of its prompt
                    i += 1
                    continue
            plan = None
            if verify and num_new == remaining and self._drafting(seq):
                plan = self._speculate(seq, num_new, budget if decoding else None, propose, streak)
            # One allocation of the plan (less its speculation on a dry pool), else preemptions.
            if plan is None:
                speculating = take_slots(seq, num_new, num_new, 0)
            else:
                speculating = take_slots(seq, plan.tokens, num_new, plan.lookahead)
            while speculating is None:
                self._settle_cap(out)  # before the running set changes
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # already passed this step
                    unscheduled = out.unschedule(victim)
                    budget += unscheduled
                    others -= unscheduled and not self._decodes(victim)
                    i -= 1
                self._preempt(victim, out)
                if victim is seq:
                    break
                if plan is not None and (plan.tokens != num_new or plan.lookahead):
                    plan = None  # its speculation took more: the plain tokens alone
                if plan is None:
                    speculating = take_slots(seq, num_new, num_new, 0)
                else:
                    speculating = take_slots(seq, plan.tokens, num_new, plan.lookahead)
            else:  # commit
                if plan is not None and speculating:
                    if plan.draft:
                        out.drafts[seq] = plan.draft
                        num_new = plan.tokens
                    if plan.after:
                        out.propose[seq] = plan.after
                add_seq(seq)
                add_num(num_new)
                if not decoding:
                    others += 1
                budget -= num_new
                if cost is not None:
                    self._work -= cost(seq.num_computed_tokens, num_new)
                i += 1
        if not out.preempted:  # under pressure, admit nobody new this step
            budget, others = self._admit(out, budget, propose, seated_waiting, others, streak)
        # The flags, from what was committed: every sequence decodes (admissions never do) with
        # no drafts to verify; and besides, nothing preempted and no running one left out.
        decodes = not others
        out.only_decodes = decodes and not out.drafts
        out.all_decoding = decodes and not out.preempted and len(out.seqs) == len(running)
        step = self.num_steps
        for seq in out.seqs:
            seq.last_step = step
        self._cap_sitting_out = None
        if self.floor_fit is not None:
            if cost is not None and not out.preempted:  # the work charged to the budget as it was planned
                self._planned_work = self._work_start - self._work
            else:  # a preemption took back work charged (or tokens alone were not charged): count it
                chunk = self.cost.chunk
                self._planned_work = sum(
                    chunk(s.num_computed_tokens, n) for s, n in zip(out.seqs, out.num_new, strict=True)
                )
        # A seat given is a turn taken, used or not: a waiting sequence the pool, the budgets or
        # max_num_seqs kept out goes behind the running ones that sat out for it, which are then
        # seated first (they may be what frees the room it needs).
        for seq in seated_waiting or ():
            if seq.status == SeqStatus.WAITING:
                seq.last_step = step
        out.layout = (
            LogitsLayout.decodes(out.seqs)
            if out.only_decodes
            else LogitsLayout.build(out.seqs, out.num_new, out.drafts)
        )
        # The step as plain data for the runner, with every KV change since the last step (this
        # schedule's, and the last update's and aborts' since): the runner follows them and nothing else.
        out.output = self.output_builder.build(out, self.kv.take_step_changes())
        return out

    def _settle_cap(self, out: ScheduledStep) -> None:
        """Bound the step's work by the decode cap if it has one, once: as if from the start of the
        planning, with the work of the running sequences committed since charged again, in order
        (nothing was taken back yet: a preemption settles the cap first)."""
        sitting_out = self._cap_sitting_out
        if sitting_out is None:
            return
        self._cap_sitting_out = None
        cap = self._decode_cap(sitting_out)
        if cap is None:
            return
        work = self._work_start = min(self.cost.budget, cap)
        if self.cost.ratio:  # the running loop charges its sequences' work (admissions come later)
            chunk = self.cost.chunk
            for seq, n in zip(out.seqs, out.num_new, strict=True):
                work -= chunk(seq.num_computed_tokens, n)
        self._work, self._capped = work, True

    def _decode_cap(self, sitting_out) -> float | None:
        """The step's work bound while sequences decode in it and prompt work waits (None: none;
        ``step_cost.decode_cap``)."""
        prompt = bool(self.waiting.ready)
        if not prompt:  # unless a running sequence has prompt work: the steady decode step, no cap
            for seq in self.running:
                if seq.request.paused or seq in sitting_out:
                    continue
                num_tokens = len(seq.token_ids)
                if num_tokens - seq.num_computed_tokens != 1 or num_tokens == seq.request.num_prompt_tokens:
                    prompt = True
                    break
            if not prompt:
                return None
        decode_work = 0.0
        chunk = self.cost.chunk
        for seq in self.running:
            if seq.request.paused or seq in sitting_out:
                continue
            num_tokens = len(seq.token_ids)
            if num_tokens - seq.num_computed_tokens == 1 and num_tokens != seq.request.num_prompt_tokens:
                decode_work += chunk(seq.num_computed_tokens, 1)
        if not decode_work:
            return None
        floor = self.step_floor if self.floor_fit is None else self.floor_fit.floor(self.step_floor)
        return decode_cap(decode_work, self.stall_factor, floor)

    def _seats(self) -> tuple[set[Sequence], list[Sequence] | None]:
        """Who takes the step's ``max_seqs_per_step`` seats, when more sequences could: the running
        ones that sit this step out, and the waiting ones that may be admitted into it, in order
        (None: seats are no limit; admit in the queue's order).

        Running and waiting sequences share the seats, in rounds over the clients
        (``Request.client``) that sent them: each client with a sequence to compute takes one seat
        a round, the one it was given a seat least recently (a new one has never had a seat; the
        waiting before the running on a tie, in the queue's order); within a round the clients
        stepped least recently go first. A seat a waiting sequence could not use (the pool, the
        budgets or ``max_num_seqs`` kept it out) counts as its turn, so the running ones that sat
        out for it come first next step and nothing waits on itself. So a client's first request
        is admitted in the next step however many another client has queued or running, and
        admissions count against the seats like any sequence. Under the priority policy a more
        urgent sequence is seated before any less urgent one, in rounds within each priority.
        Deterministic: ties fall by position in the running list (waiting ones: in the queue)."""
        waiting, cap = self.waiting.ready, self.max_per_step
        if len(self.running) + len(waiting) <= cap:  # the steady state: no list built per step
            return set(), None
        runnable = [s for s in self.running if not s.request.paused]
        if len(runnable) + len(waiting) <= cap:
            return set(), None
        prio = self.priority
        # (level, last_step, kind, position): kind 0 waiting (queue order), 1 running
        candidates = [
            ((s.request.priority if prio else 0, s.last_step, 0, j), s)
            for j, s in enumerate(waiting)
            if not s.request.waiting_for_grammar
        ]
        candidates += [
            ((s.request.priority if prio else 0, s.last_step, 1, j), s) for j, s in enumerate(runnable)
        ]
        candidates.sort(key=lambda item: item[0])
        taken: dict[tuple[int, str], int] = {}  # (priority, client) -> seats its earlier sequences hold
        ranked = []
        for (level, last, kind, j), s in candidates:
            group = (level, s.request.client)
            depth = taken.get(group, 0)
            taken[group] = depth + 1
            ranked.append(((level, depth, last, kind, j), s))
        ranked.sort(key=lambda item: item[0])
        seated = ranked[:cap]
        out = {s for _, s in ranked[cap:] if s.status == SeqStatus.RUNNING}
        return out, [s for _, s in seated if s.status == SeqStatus.WAITING]

    def _drafting(self, seq: Sequence) -> bool:
        """Whether ``seq`` still speculates: it may, and its drafts have not stopped paying."""
        spec = self.spec
        return seq.request.can_speculate and not (
            seq.num_drafted >= spec.min_drafted and seq.num_accepted < spec.min_acceptance * seq.num_drafted
        )

    def _may_draft_after(self, seq: Sequence) -> bool:
        """Whether the proposer may draft for ``seq`` after the step that samples it: it still
        speculates, and it is no ``n > 1`` prompt about to fork (its drafts would be no index's)."""
        request = seq.request
        return (request.forked or request.params.n == 1) and self._drafting(seq)

    def _drafts_after(self, seq: Sequence, propose: bool, streak: bool) -> bool:
        """Whether the proposer drafts for ``seq`` after this step: the governor lets the step's
        sequences draft (``propose``) or ``seq`` is on a streak where streaks pay (``streak``), and
        it may draft at all."""
        return (propose or (streak and seq.draft_streak)) and self._may_draft_after(seq)

    def _speculate(
        self, seq: Sequence, num_new: int, budget: int | None, propose: bool, streak: bool = False
    ) -> Speculation | None:
        """The speculation in the plan of a running sequence that samples this step with its
        ``num_new`` tokens: the drafts it holds that it verifies (a decode, with ``budget`` tokens
        left; None: it does not decode), and how many drafts the proposer may make after it (None:
        neither)."""
        draft = None
        if budget is not None:
            # Never past max_tokens: the last draft's successor is the bonus token.
            k = min(budget - 1, seq.request.length_limit - len(seq.token_ids) - 1)
            draft = seq.spec_token_ids[:k] if seq.spec_token_ids and k > 0 else None
        after = self.spec.num_speculative_tokens if self._drafts_after(seq, propose, streak) else 0
        if not draft and not after:
            return None
        tokens = 1 + len(draft) if draft else num_new
        return Speculation(draft, after, tokens, self.num_lookahead if after else 0)

    def _take_slots(
        self, seq: Sequence, planned: int, plain: int, lookahead: int, cached=None
    ) -> bool | None:
        """The one place the scheduler takes KV blocks: for ``seq``'s ``planned`` tokens and
        ``lookahead`` slots after them, in one allocation; on a dry pool, for its ``plain`` tokens
        alone (its speculation dropped for this step). True: the plan took its blocks; False: only
        the plain tokens did; None: not even those (nothing was taken)."""
        num_new, ahead, whole = planned, lookahead, True
        while not self.kv.allocate(seq, num_new, cached, ahead):
            if num_new == plain and not ahead:
                return None
            num_new, ahead, whole = plain, 0, False
        return whole

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        """It computes its one last token and has sampled before (no prompt chunk, no fork due)."""
        num_tokens = len(seq.token_ids)
        return num_tokens - seq.num_computed_tokens == 1 and num_tokens != seq.request.num_prompt_tokens

    def _admit(
        self,
        out: ScheduledStep,
        budget: int,
        propose: bool,
        seated: list[Sequence] | None,
        others: int,
        streak: bool = False,
    ) -> tuple[int, int]:
        """Admit waiting sequences while the token and work budgets, ``max_num_seqs`` and the pool
        allow: ``seated`` (those given seats this step, in order), or with None the queue's ready
        ones in its order (paused requests' sequences are not in it). Returns the token budget and
        the scheduled sequences that do not just decode (``others``, with the admitted ones, less
        those a preemption here took out)."""
        order = list(self.waiting.ready) if seated is None else seated
        j = 0
        if not order:
            return budget, others
        # Paused sequences hold no seat: a client that stops reading must not keep others out.
        seats = self.config.max_num_seqs - sum(1 for s in self.running if not s.request.paused)
        publish = self.kv.enable_prefix_caching
        adapters = self.running_adapters() if self.max_loras else None
        while j < len(order) and budget > 0 and seats > 0:
            seq = order[j]
            request = seq.request
            if request.waiting_for_grammar:
                j += 1
                continue
            lora = None if request.lora is None else (request.lora.name, request.lora.version)
            if lora is not None and lora not in adapters and len(adapters) >= self.max_loras:
                j += 1  # every slot is taken by adapters in use: it waits for one to free up
                continue
            if request.grammar is not None and seq.matcher is None:
                try:
                    seq.matcher = request.grammar.result()
                except Exception as e:  # noqa: BLE001 - reported to the caller as the request's end
                    self.waiting.discard(seq)
                    self._fail(seq, f"structured output: {e}", out)
                    j += 1
                    continue
            cached = self.kv.find_cached_prefix(seq)
            if self._computed_elsewhere(seq, len(cached)):
                self.num_held += 1  # it waits for those blocks, then hits them (no blocks held)
                j += 1
                continue
            hit = self.kv.hit_length(cached)
            remaining = seq.num_tokens - hit
            if not self.config.enable_chunked_prefill:
                if remaining > budget:
                    break
                num_new = remaining
            else:
                num_new = self._fit(out, hit, min(remaining, budget))
                if num_new == 0:  # the step's work budget is spent
                    break
            # A prompt this step completes may draft after it (the first decode verifies them).
            drafts_after = num_new == remaining and self._drafts_after(seq, propose, streak)
            ahead = self.num_lookahead if drafts_after else 0
            speculating = self._take_slots(seq, num_new, num_new, ahead, cached)
            if speculating is None:
                self._settle_cap(out)  # before the running set changes
                victim = self._lower_priority_victim(seq, out.published_early)
                if victim is None:
                    break
                unscheduled = out.unschedule(victim)
                budget += unscheduled
                others -= unscheduled and not self._decodes(victim)
                self._preempt(victim, out)
                adapters = self.running_adapters() if self.max_loras else None
                continue  # the pool changed: this sequence again
            if cached:
                seq.num_computed_tokens = hit
            if lora is not None:
                adapters.add(lora)
            self.waiting.discard(seq)
            j += 1
            if publish:  # its prompt's blocks, to the requests admitted after it in this very step
                self.kv.register_computed_blocks(seq, scheduled=num_new)
                out.published_early.add(seq)
            self.kv.note_admission(seq, hit)
            if not seq.admitted_before:
                seq.num_cached_tokens = hit
                seq.admitted_before = True
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.add(seq, num_new)
            if drafts_after and speculating:
                out.propose[seq] = self.spec.num_speculative_tokens
            budget -= num_new
            self._work -= self.cost.chunk(seq.num_computed_tokens, num_new)
            seats -= 1
            others += 1
        return budget, others

    def _computed_elsewhere(self, seq: Sequence, first: int) -> bool:
        """Whether the first block a waiting ``seq`` would compute (block ``first``, past its
        prefix-cache hit) is being computed by a running sequence: the same block of the same
        prompt (an equal chain hash), full in that sequence's tokens, which it has not computed
        yet. Then ``seq`` is not admitted this step (two sessions that arrive together with one
        long system prompt compute it once: the second waits for the first's blocks and hits
        them). It holds no blocks while it waits, so nothing can deadlock on it, and only a
        running, unpaused sequence holds it back: one preempted, aborted or finished holds no
        one. A request that cannot use the cache (prompt logprobs) never waits."""
        kv = self.kv
        if not kv.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return False
        bs = kv.block_size
        end = (first + 1) * bs  # the tokens up to the end of that block
        if (seq.num_tokens - 1) // bs <= first:  # no full block left that it could hit
            return False
        registered, want = kv.registered, None
        for other in self.running:
            if (
                other.num_computed_tokens >= end  # computed it (or decodes past it)
                or len(other.token_ids) < end  # it is not full there
                or registered.get(other, 0) > first  # published (scheduled this step)
                or other.request.paused
            ):
                continue
            if want is None:
                want = kv.block_hashes(seq, first + 1)[first]
            if kv.block_hashes(other, first + 1)[first] == want:
                return True
        return False

    def _fit(self, out: ScheduledStep, start: int, num_new: int) -> int:
        """The tokens of a prompt chunk from position ``start`` (at most ``num_new``, the token
        budget's share) that the step's work budget still takes. Cut by the work budget, a chunk
        ends on a block boundary where it spans one; the step's first chunk gets at least the
        tokens up to the next boundary (beside decodes, one token), so that a prompt always
        advances."""
        self._prefilled, first = True, not self._prefilled
        self._settle_cap(out)
        if not self.cost.ratio and not self._capped:
            return num_new
        n = self.cost.max_tokens(start, self._work, num_new)
        if n == num_new:
            return n
        bs = self.kv.block_size
        end = start + n
        if end - end % bs > start:
            return end - end % bs - start
        if not first:
            return n
        # Beside decodes the prompt advances by at least a token; alone, by the rest of its block.
        return max(n, 1) if self._capped else max(n, min(num_new, bs - start % bs))

    def running_adapters(self) -> set[tuple[str, int]]:
        """(name, version) of the LoRA adapters running sequences use: their slots are pinned."""
        return {(s.request.lora.name, s.request.lora.version) for s in self.running if s.request.lora}

    def _fail(self, seq: Sequence, why: str, out: ScheduledStep) -> None:
        """End a request that cannot run (its grammar did not compile): an abort delta says why."""
        request = seq.request
        log.warning("request %s ends: %s", request.request_id, why)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        request.ended.update(range(request.params.n))
        out.failed.append(
            RequestDelta(
                request.request_id,
                0,
                [],
                None,
                FinishReason.ABORT,
                None,
                request.num_prompt_tokens,
                error=why,
                request_finished=True,
            )
        )

    def _lower_priority_victim(self, seq: Sequence, keep: set[Sequence]) -> Sequence | None:
        """The running sequence that a waiting ``seq`` may evict, if any: a paused one, or under the
        priority policy one of lower priority. Never one in ``keep``: a sequence that published
        blocks this step, which others admitted after it may already share, must compute them."""
        paused = self._paused_victim()
        if paused is not None:
            return paused
        candidates = [s for s in self.running if s not in keep] if keep else self.running
        if not self.priority or not candidates:
            return None
        victim = max(candidates, key=_priority_key)
        return victim if _priority_key(victim) > _priority_key(seq) else None

    def _paused_victim(self) -> Sequence | None:
        """A paused sequence needs its blocks least: it gives them up first (the latest admitted)."""
        return next((s for s in reversed(self.running) if s.request.paused), None)

    def _pick_victim(self) -> Sequence:
        paused = self._paused_victim()
        if paused is not None:
            return paused
        if self.priority:
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _recompute(self, seq: Sequence, out: ScheduledStep) -> None:
        """``seq`` grew past its model's rotary switch (``KVCacheManager.needs_recompute``): its
        blocks go, and it waits to compute every token again with the table its length selects
        (as a preemption does; counted apart)."""
        self._preempt(seq, out, rope_switch=True)

    def _preempt(self, seq: Sequence, out: ScheduledStep, rope_switch: bool = False) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        if rope_switch:
            self.num_rope_recomputes += 1
        else:
            self.num_preemptions += 1
        out.preempted.append(seq)
        self.waiting.requeue(seq)

    def check_invariants(self) -> None:
        """Reads only. Every sequence holding blocks is queued; between steps none holds a block
        past its tokens and its drafts (a rejected draft's lookahead blocks are released once it is
        verified); the pool's ref counts equal the tables' references."""
        queued = {id(s) for s in self.running} | {id(s) for s in self.waiting}
        bs = self.kv.block_size
        null = self.kv.null_block  # the page released window entries name: held by the manager
        holders: dict[int, int] = {} if null is None else {null: 1}
        tables0 = self.kv.tables
        for g, seq, table in self.kv.all_holders():
            assert id(seq) in queued, f"sequence {seq.seq_id} holds blocks but is in no queue"
            # Only a draft model's drafts keep slots past the next token (their K/V is written).
            need = len(seq.token_ids) + (len(seq.spec_token_ids) if self.num_lookahead else 0)
            assert len(table) <= cdiv(need, bs), (
                f"sequence {seq.seq_id} holds {len(table)} blocks for {need} tokens and drafts"
            )
            assert len(table) == len(tables0.get(seq, ())), f"sequence {seq.seq_id}'s groups differ in length"
            if self.kv.windows[g] is not None:  # released entries lead, held ones follow
                k = self.kv.num_released(g, seq)
                assert all(b == null for b in table[:k]) and null not in table[k:], (
                    f"sequence {seq.seq_id}: group {g}'s table mixes released and held entries"
                )
            for block_id in table:
                if block_id != null:
                    holders[block_id] = holders.get(block_id, 0) + 1
        self.kv.pool.check_invariants(holders)

    def note_step_time(self, out: ScheduledStep, seconds: float, deltas: list[RequestDelta]) -> None:
        """The governor learns from decode steps: how long one took, for how many tokens; the
        floor fit from every step with work in it, against the work it planned."""
        if self.floor_fit is not None and self._planned_work > 0:
            self.floor_fit.observe(self._planned_work, seconds, not out.all_decoding)
        if self.governor is not None and out.all_decoding and out.num_running <= self.spec.max_batch:
            tokens = sum(len(d.new_token_ids) for d in deltas)
            self.governor.record(out.num_running, bool(out.drafts), seconds, tokens)

    # --- applying a step ------------------------------------------------------------------------
    def store_spilled(self, result: StepResult) -> None:
        """The blocks this step evicted, read out by the runner before its forward: to the lower
        KV tiers (engine_svc/kv_tiers). Called every step, scheduled sequences or not."""
        if result.spilled:
            self.kv.store_spilled(result.spilled)

    def update_from_output(self, out: ScheduledStep, result: StepResult) -> list[RequestDelta]:
        kv, bs = self.kv, self.kv.block_size
        caching = kv.enable_prefix_caching
        registered = kv.registered
        drafts = out.drafts
        for seq, n in zip(out.seqs, out.num_new, strict=True):
            if drafts and seq in drafts:
                continue  # its counter moves by what verification accepts, below
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            if caching and computed // bs > registered.get(seq, 0):
                kv.register_computed_blocks(seq)
        layout = out.layout
        for chunk, entries in zip(layout.prompt_chunks, result.prompt_logprobs, strict=True):
            chunk.seq.request.record_prompt_logprobs(chunk.first, entries)
        tokens, logprobs = result.token_ids, result.logprobs
        if len(layout.sampled) == layout.num_sample_rows:  # one token per sequence: the steady state
            emissions = zip(layout.sampled, ([t] for t in tokens), ([lp] for lp in logprobs), strict=True)
        else:  # forks, or drafts to verify
            emissions = self._expand(layout, tokens, logprobs)
        deltas: list[RequestDelta] = []
        owners: list[Request] = []
        finished: list[Sequence] = []
        # The one stop rule, once per sampled token (a loop on locals: it runs for every token).
        for seq, toks, lps in emissions:
            request = seq.request
            matcher = seq.matcher
            dead_end = None
            for k, token in enumerate(toks):
                if token == DEAD_END_TOKEN:
                    # Nothing the request may sample satisfies its controls (a grammar's mask met
                    # allowed ids that exclude it all, or bans took the rest): end it, emit
                    # nothing, never loop.
                    dead_end = dead_end_error(request.params)
                    log.warning("request %s: %s", request.request_id, dead_end)
                    seq.finish_reason = FinishReason.ABORT
                    toks, lps = toks[:k], lps[:k]
                    finished.append(seq)
                    break
                seq.token_ids.append(token)
                num_tokens = len(seq.token_ids)
                if token in request.stop_ids and num_tokens >= request.min_stop_len:
                    seq.finish_reason, seq.stop_token_id = FinishReason.STOP, token
                elif matcher is not None and not matcher.consume_token(token):
                    # The mask allowed a token its matcher refuses: the library disagrees with itself.
                    log.error(
                        "request %s: its grammar refused token %d after allowing it",
                        request.request_id,
                        token,
                    )
                    seq.finish_reason = FinishReason.ABORT
                elif num_tokens >= request.length_limit:
                    seq.finish_reason = FinishReason.LENGTH
                elif matcher is not None and matcher.is_stopped():  # the grammar is complete
                    seq.finish_reason = FinishReason.STOP
                else:
                    continue
                finished.append(seq)
                if k + 1 < len(toks):  # verified tokens past a stop are not output
                    toks, lps = toks[: k + 1], lps[: k + 1]
                break
            delta = RequestDelta(
                request.request_id,
                seq.index,
                toks,
                None if not lps or lps[0] is None else lps,
                seq.finish_reason,
                seq.stop_token_id,
                request.num_prompt_tokens,
                seq.num_cached_tokens,
                error=dead_end,
                num_draft_tokens=seq.num_drafted,
                num_accepted_draft_tokens=seq.num_accepted,
            )
            if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                delta.prompt_logprobs = request.prompt_logprobs
                request.prompt_logprobs_sent = True
            deltas.append(delta)
            owners.append(request)
        for seq in finished:
            seq.request.ended.add(seq.index)
            self.remove(seq)
        if out.only_decodes and not finished and out.output is not None:  # one token each: next deltas
            self.output_builder.appended(out, tokens)
        if self.spec is not None:
            self._keep_drafts(out, result.drafts)
        if finished:  # the last delta of a request that has nothing more to send says so
            done = {seq.request for seq in finished if seq.request.finished}
            for delta, request in zip(reversed(deltas), reversed(owners), strict=True):
                if request in done:
                    delta.request_finished = True
                    done.discard(request)
        for seq in layout.pooled:  # embedding requests whose prompt ended: their vector, no token
            deltas.append(self._end_embedding(seq, result.pooled[seq.request.request_id]))
        if kv.tiers is not None:  # the blocks this step completed, down to the tiers (next step)
            kv.write_through(out.seqs)
        return deltas

    def _end_embedding(self, seq: Sequence, vector: bytes) -> RequestDelta:
        """An embedding request whose prompt this step ended (its counters moved and its blocks
        were published above, for prefix hits) finishes with its vector and no token."""
        request = seq.request
        seq.finish_reason = FinishReason.STOP
        request.ended.add(seq.index)
        self.remove(seq)
        return RequestDelta(
            request.request_id,
            seq.index,
            [],
            finish_reason=seq.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            request_finished=True,
            embedding=vector,
        )

    def _keep_drafts(self, out: ScheduledStep, proposed: dict[int, list[int]]) -> None:
        """Now that their tokens are in: each sequence that sampled keeps the drafts proposed after
        them (or none), a verified one publishes its blocks, and the blocks past the next token's
        slot go back, but for those a draft model's drafts have their K/V in (verified next)."""
        kv, drafts, lookahead = self.kv, out.drafts, self.num_lookahead
        for seq in out.layout.sampled:
            if seq.finish_reason is not None:
                continue
            draft = proposed.get(seq.seq_id) or []
            if draft and seq.matcher is not None and not lookahead:
                # Only the n-gram drafts its grammar accepts after the tokens just consumed are
                # worth verifying (a draft model's stay whole: their K/V is written).
                draft = draft[: seq.matcher.validate_tokens(draft)]
            seq.spec_token_ids = draft
            if seq in drafts:
                # A draft model's cache holds every token the target computed by now (its
                # proposer's rule, spec_decode/draft_model.py): the blocks are both models'.
                kv.register_computed_blocks(seq)
            if lookahead or seq in drafts:
                kv.trim(seq, len(seq.spec_token_ids) if lookahead else 0)

    def _expand(self, layout: LogitsLayout, tokens: list[int], logprobs: list):
        """(sequence, its tokens, their logprobs) for each sampled sequence, when some rows are not
        simply one sequence's next token: a fork's n first tokens, or drafts under verification."""
        out = []
        r = 0
        drafts = layout.drafts or [None] * len(layout.sampled)
        for seq, fan, draft in zip(layout.sampled, layout.fans, drafts, strict=True):
            if draft is not None:
                out.append(self._verify(seq, draft, tokens[r : r + fan], logprobs[r : r + fan]))
            elif fan == 1:
                out.append((seq, [tokens[r]], [logprobs[r]]))
            else:
                out.extend(self._fork(seq, tokens[r : r + fan], logprobs[r : r + fan]))
            r += fan
        return out

    def _verify(self, seq: Sequence, draft: list[int], sampled: list[int], lps: list):
        """The accepted drafts and the bonus token (spec_decode/acceptance.py: greedy and seeded
        requests get the very tokens they would get without speculation)."""
        accepted = num_accepted(draft, sampled)
        seq.draft_streak = accepted == len(draft)
        seq.num_drafted += len(draft)
        seq.num_accepted += accepted
        self.num_drafted += len(draft)
        self.num_accepted += accepted
        # The last token and the accepted drafts have their K/V; rejected positions lie past the
        # counter (overwritten later) and their lookahead blocks are released once tokens are added.
        seq.num_computed_tokens += 1 + accepted
        return seq, sampled[: accepted + 1], lps[: accepted + 1]

    def _fork(self, seq: Sequence, tokens: list[int], logprobs: list):
        """An ``n > 1`` prompt completed: fork its other sequences, each taking its own first token
        and sharing every block of sequence 0 by reference (copy-on-write on the first write).
        Indexes aborted before the fork are never created; sequence 0, if aborted, stops here."""
        request = seq.request
        request.forked = True
        at = self.running.index(seq) + 1
        out = []
        for i in range(len(tokens)):
            if i in request.ended:
                continue
            if i == 0:
                child = seq
            else:
                child = Sequence(request, i, list(seq.token_ids), block_hashes=list(seq.block_hashes))
                if seq.matcher is not None:
                    child.matcher = seq.matcher.deep_copy()  # before sequence 0 consumes its token
                child.num_cached_tokens, child.admitted_before = seq.num_cached_tokens, True
                child.num_computed_tokens = seq.num_computed_tokens
                self.kv.fork(seq, child)
                child.status = seq.status
                request.sequences.append(child)
                self.running.insert(at, child)
                at += 1
            out.append((child, [tokens[i]], [logprobs[i]]))
        if 0 in request.ended:  # aborted before the fork: it carried the prompt, and is done
            seq.finish_reason = FinishReason.ABORT
            self.remove(seq)
        return out
