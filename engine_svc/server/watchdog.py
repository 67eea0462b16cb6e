"""Notice an engine that has work but makes no progress.

``StallDetector`` is the rule, kept free of threads and clocks so that it can be tested alone: the
engine is stalled when work has been pending for longer than the timeout without a step
completing. The engine process runs it on a thread of its own (``Watchdog``) beside the engine
loop, since a loop stuck in a forward pass cannot check itself; the gateway runs the same rule on
what it sees of the engine (step outputs and the step counter of heartbeats), which also catches
an engine whose own watchdog is off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("engine_svc.server")


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

    def stalled(self, now: float) -> bool:
        return self.timeout_s > 0 and self._pending and now - self._since > self.timeout_s

    def stalled_for(self, now: float) -> float:
        return now - self._since if self._pending else 0.0


class Watchdog:
    """Calls ``on_stall`` once when the detector says stalled, ``on_recover`` once progress resumes.

    The engine loop reports with ``step_started()`` / ``step_finished(pending)`` / ``idle()``; those
    take a lock only for a few assignments, so the loop pays nothing measurable per step."""

    def __init__(
        self,
        timeout_s: float,
        on_stall: Callable[[float], None],
        on_recover: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.detector = StallDetector(timeout_s)
        self._on_stall, self._on_recover = on_stall, on_recover
        self._clock = clock
        self._lock = threading.Lock()
        self._tripped = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def tripped(self) -> bool:
        return self._tripped

    def step_started(self) -> None:
        with self._lock:
            self.detector.update(self._clock(), pending=True, progressed=False)

    def step_finished(self, pending: bool) -> None:
        self._progress(pending)

    def idle(self) -> None:
        self._progress(False)

    def _progress(self, pending: bool) -> None:
        with self._lock:
            self.detector.update(self._clock(), pending=pending, progressed=True)
            recovered, self._tripped = self._tripped, False
        if recovered:
            log.warning("watchdog: the engine makes progress again")
            self._on_recover()

    def check(self) -> bool:
        """One look; returns True when this look tripped the watchdog."""
        with self._lock:
            now = self._clock()
            if self._tripped or not self.detector.stalled(now):
                return False
            self._tripped = True
            waited = self.detector.stalled_for(now)
        log.error("watchdog: no engine step completed for %.1fs while work is pending", waited)
        self._on_stall(waited)
        return True

    def start(self) -> None:
        if self.detector.timeout_s <= 0:
            return
        period = min(0.25, self.detector.timeout_s / 4)

        def run() -> None:
            while not self._stop.wait(period):
                self.check()

        self._thread = threading.Thread(target=run, name="engine-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
