"""The scheduler's own record of a step it planned: the ``Sequence`` objects it scheduled, how many
tokens each computes, the drafts they verify, the preemptions, and the logits layout over them.

``Scheduler.schedule`` returns it and ``Scheduler.update_from_output`` applies the step's result to
it; nothing on the runner's side reads it. What the runner reads is ``output``, the same step as
plain data (``scheduler_output.SchedulerOutput``: ids, token ids, block ids, counts), built from this
record once the plan is final (``output_builder.OutputBuilder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_svc.logits_layout import LogitsLayout
from engine_svc.outputs import RequestDelta
from engine_svc.scheduler_output import SchedulerOutput
from engine_svc.sequence import Sequence


@dataclass
class ScheduledStep:
    seqs: list[Sequence] = field(default_factory=list)  # scheduled, in batch order
    num_new: list[int] = field(default_factory=list)  # tokens each computes this step
    preempted: list[Sequence] = field(default_factory=list)
    # Every scheduled sequence computes only its last token and has sampled before (so no prompt
    # chunk, no fork due): the model runner builds its inputs on a short path.
    only_decodes: bool = True
    layout: LogitsLayout | None = None  # set once the schedule is final
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # speculative tokens to verify
    # Sequences the runner's proposer drafts for after this step samples, and at most how many
    # drafts each (a draft model writes their K/V into lookahead slots allocated with this step).
    propose: dict[Sequence, int] = field(default_factory=dict)
    published_early: set[Sequence] = field(default_factory=set)  # admitted; blocks published already
    # Every scheduled sequence decodes (no prompt chunk, no admission, no preemption): the step's
    # time per token is comparable with other such steps (speculation's governor measures these).
    all_decoding: bool = True
    num_running: int = 0  # running sequences when it was planned
    failed: list[RequestDelta] = field(default_factory=list)  # requests that could not start
    output: SchedulerOutput | None = None  # the step as the runner reads it (set once the plan is final)

    @property
    def copies(self):
        """The copy-on-write copies the step runs before its forward (its output's)."""
        return self.output.copies

    @property
    def tier_ops(self):
        """The moves to and from the lower KV tiers the step runs before its forward (its output's)."""
        return self.output.tier_ops

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)

    def unschedule(self, seq: Sequence) -> int:
        self.drafts.pop(seq, None)
        self.propose.pop(seq, None)
        for j, s in enumerate(self.seqs):
            if s is seq:
                del self.seqs[j]
                return self.num_new.pop(j)
        return 0
