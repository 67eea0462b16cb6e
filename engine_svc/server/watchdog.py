"""The engine process's watchdog: ``engine_svc.rpc.stall.StallDetector`` run on a thread of its own
beside the engine loop, since a loop stuck in a forward pass cannot check itself. Each look also
reads a progress counter (the decoder layers run: ``engine_svc.models.layer_progress``): while it
moves, the step in progress is long, not stuck."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine_svc.rpc.stall import StallDetector

log = logging.getLogger("engine_svc.server")


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
        progress: Callable[[], int] | None = None,
    ) -> None:
        self.detector = StallDetector(timeout_s)
        self._layers = progress
        self._seen = progress() if progress is not None else 0
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
            if self._layers is not None:
                seen = self._layers()
                if seen != self._seen:
                    self._seen = seen
                    self.detector.note_progress(now)
            if self._tripped or not self.detector.stalled(now):
                return False
            self._tripped = True
            waited = self.detector.stalled_for(now)
        log.error(
            "watchdog: no engine step completed for %.1fs while work is pending (nor a layer of the step"
            " in progress)",
            waited,
        )
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
