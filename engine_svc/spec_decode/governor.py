"""Whether drafting pays at the current batch size, measured rather than guessed.

A step that verifies drafts computes k + 1 positions per drafting sequence. Where the step's cost
is mostly fixed (small batches, memory-bound weights) that is nearly free and each accepted draft
saves a step; where the step is compute-bound (larger batches, a CPU with few threads) the extra
positions cost about what they save, or more. Which regime a batch size is in depends on the
model, the device and the machine's load, so the engine measures it: per number of running
sequences, a moving average of seconds per emitted token over decode steps with drafts and over
decode steps without; drafting goes on where it is cheaper. The other choice is taken again every
``explore_every`` steps at that size, so a change (acceptance, load) is noticed.

The average over drafted steps mixes sequences (and stretches of one) whose drafts are all accepted
with those whose drafts all fail; ``full_drafts_pay`` asks about the former alone, for the
scheduler's per-sequence rule: a sequence whose last drafts were all accepted drafts on where a
step of fully accepted drafts is cheaper per token than a plain one."""

from __future__ import annotations


class SpeculationGovernor:
    def __init__(self, explore_every: int = 16, alpha: float = 0.25):
        self.explore_every = explore_every
        self.alpha = alpha
        # (running sequences, drafted) -> moving average of seconds per emitted token
        self.cost: dict[tuple[int, bool], float] = {}
        # (running sequences, drafted) -> moving average of seconds per step
        self.step_cost: dict[tuple[int, bool], float] = {}
        self._steps: dict[int, int] = {}

    def allow(self, batch: int) -> bool:
        """Whether this step may draft, with ``batch`` sequences running."""
        step = self._steps[batch] = self._steps.get(batch, 0) + 1
        on, off = self.cost.get((batch, True)), self.cost.get((batch, False))
        if on is None:
            return True
        if off is None:
            return False
        better = on < off
        return not better if step % self.explore_every == 0 else better

    def record(self, batch: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A decode step (no prompt chunk in it) took ``seconds`` and emitted ``tokens``."""
        if tokens <= 0:
            return
        per_token = seconds / tokens
        key = (batch, drafted)
        old = self.cost.get(key)
        self.cost[key] = per_token if old is None else old + self.alpha * (per_token - old)
        old = self.step_cost.get(key)
        self.step_cost[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def full_drafts_pay(self, batch: int, tokens: int) -> bool:
        """Whether a step with drafts, at ``batch`` sequences, costs less per token than a plain
        step when one sequence emits ``tokens`` in it (all its drafts accepted): the average cost
        per token over all drafted steps mixes runs of copied text with novel text, this asks about
        the former. Exact at one sequence; above, it counts one sequence's tokens against the whole
        step, so it errs on the side of not drafting. True until both are measured."""
        on, off = self.step_cost.get((batch, True)), self.cost.get((batch, False))
        return on is None or off is None or on / tokens < off
