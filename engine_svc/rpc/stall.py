"""Notice an engine that has work but makes no progress.

``StallDetector`` is the rule, kept free of threads and clocks so that it can be tested alone: the
engine is stalled when work has been pending for longer than the timeout without progress: a step
completing, or a step in progress running one more decoder layer (``note_progress``). A long step
whose layers keep advancing is slow, not hung; one stuck anywhere (inside a layer, or before or
after the layers) shows no progress and is caught within the timeout. The engine process runs it
on a watchdog thread beside its loop (``engine_svc.server.watchdog``); the gateway runs the same
rule on what it sees of the engine (step outputs, and the step counter and layer count of
heartbeats), which also catches an engine whose own watchdog is off.
"""

from __future__ import annotations


class StallDetector:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # 0 or less: never stalled
        self._pending = False
        self._since = 0.0  # when the current wait for progress began

    def update(self, now: float, pending: bool, progressed: bool) -> None:
        """Record what happened at ``now``: whether work is pending, and whether a step completed."""
        if progressed or (pending and not self._pending):
            self._since = now
        self._pending = pending

    def note_progress(self, now: float) -> None:
        """The step in progress advanced (a layer completed): the wait starts again."""
        self._since = now

    def stalled(self, now: float) -> bool:
        return self.timeout_s > 0 and self._pending and now - self._since > self.timeout_s

    @property
    def since(self) -> float:
        """When the current wait for progress began."""
        return self._since

    def stalled_for(self, now: float) -> float:
        return now - self._since if self._pending else 0.0
