"""Whether drafting pays at the current batch size, measured rather than guessed.

A step that verifies drafts computes k + 1 positions per drafting sequence. Where the step's cost
is mostly fixed (small batches, memory-bound weights) that is nearly free and each accepted draft
saves a step; where the step is compute-bound (larger batches, a CPU with few threads) the extra
positions cost about what they save, or more. Which regime a batch size is in depends on the
model, the device and the machine's load, so the engine measures it: per number of running
sequences, a moving average of seconds per emitted token over decode steps with drafts and over
decode steps without; drafting goes on where it is cheaper. The other choice is taken again every
``explore_every`` steps at that size, so a change (acceptance, load) is noticed."""

from __future__ import annotations


class SpeculationGovernor:
    def __init__(self, explore_every: int = 16, alpha: float = 0.25):
        self.explore_every = explore_every
        self.alpha = alpha
        # (running sequences, drafted) -> moving average of seconds per emitted token
        self.cost: dict[tuple[int, bool], float] = {}
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
