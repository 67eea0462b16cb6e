"""What one step computes: the scheduler's output, the only thing the model runner reads.

Data flows one way. Per scheduled sequence: how many tokens it computes, the drafts it verifies,
and whether the proposer drafts for it after sampling; per sequence whose KV blocks changed since
the last step: its new and replaced block ids (``updates``); the sequences that hold no block
anymore (``released``); the copy-on-write copies to run before the forward; and the logits layout.
The runner's input batch is updated from this alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_svc.kv_cache_manager import BlockUpdate
from engine_svc.logits_layout import LogitsLayout
from engine_svc.outputs import RequestDelta
from engine_svc.sequence import Sequence

NO_COPIES = np.zeros((0, 2), dtype=np.int64)  # a step with no copy-on-write copies to run


@dataclass
class SchedulerOutput:
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
    # The KV cache's changes since the last step (set once the schedule is final).
    updates: list[BlockUpdate] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # seq ids: their input-batch rows go
    copies: np.ndarray = field(
        default_factory=lambda: NO_COPIES
    )  # [C, 2] int64 (src, dst) block copies before the forward
    # Moves between the pool and the lower tiers (kv_tiers/transfer.py), in order, before the
    # forward; with tiers, the copy-on-write copies are among them (and ``copies`` is empty).
    tier_ops: list | None = None
    # (parent, child) seq ids of the forks since the last step: a child's runner-side state (its
    # proposer's) starts from its parent's, as its table does.
    forks: list[tuple[int, int]] = field(default_factory=list)
    failed: list[RequestDelta] = field(default_factory=list)  # requests that could not start

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
