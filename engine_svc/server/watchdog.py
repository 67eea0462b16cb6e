"""The engine process's watchdog: ``engine_svc.rpc.stall.StallDetector`` run on a thread of its own
beside the engine loop, since a loop stuck in a forward pass cannot check itself. Each look also
reads a progress counter (the decoder layers run: ``engine_svc.models.layer_progress``): while it
moves, the step in progress is long, not stuck.

A process that gets no CPU makes no progress either: when other processes take the cores (a busy
machine, a real-time job), a layer can take longer than the timeout. With a ``cpu`` probe (the
engine's: ``process_cpu``), a wait past the timeout in which the engine had less than a quarter of
a core while one of its threads was ready to run is starvation, logged once and waited out; a hang
is a wait in which it used the CPU (a loop that never finishes a layer) or had nothing to run (a
deadlock, a blocked call)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from engine_svc.rpc.stall import StallDetector

log = logging.getLogger("engine_svc.server")

STARVED_SHARE = 0.25  # of one core, over a wait past the timeout: less is starvation (if runnable)


def process_cpu() -> tuple[float, bool]:
    """This process's CPU seconds (every thread) and whether a thread other than the caller is
    runnable (state R: running, or ready and waiting for a core)."""
    t = os.times()
    me = threading.get_native_id()
    runnable = False
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return t.user + t.system, False
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        if stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] == b"R":
            runnable = True
            break
    return t.user + t.system, runnable


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
        cpu: Callable[[], tuple[float, bool]] | None = None,
    ) -> None:
        self.detector = StallDetector(timeout_s)
        self._layers = progress
        self._cpu = cpu
        self._cpu_mark: tuple[float, float] | None = None  # (wait began, CPU seconds then)
        self._starved_logged = False
        self._starved_now = False  # the current wait, judged starved at the last look
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

    @property
    def starved(self) -> bool:
        """Whether the wait in progress is, at the last look, the engine kept from the CPU."""
        return self._starved_now

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
            if self._cpu is not None and (self._cpu_mark is None or self._cpu_mark[0] != self.detector.since):
                self._cpu_mark = (self.detector.since, self._cpu()[0])
                self._starved_logged = self._starved_now = False
            waited = self.detector.stalled_for(now)
            # Judged from a second into a wait on (the gateway reads it from heartbeats before
            # either side's timeout), so both watchdogs agree on a starved engine.
            if self._cpu is not None and waited >= min(1.0, self.detector.timeout_s / 4):
                self._starved_now = self._starved(waited, log_it=self.detector.stalled(now))
            if self._tripped or not self.detector.stalled(now) or self._starved_now:
                return False
            self._tripped = True
        log.error(
            "watchdog: no engine step completed for %.1fs while work is pending (nor a layer of the step"
            " in progress)",
            waited,
        )
        self._on_stall(waited)
        return True

    def _starved(self, waited: float, log_it: bool) -> bool:
        """Whether the wait so far is the engine kept from the CPU (see the module's docstring)."""
        if self._cpu_mark is None:
            return False
        cpu, runnable = self._cpu()
        share = (cpu - self._cpu_mark[1]) / max(waited, 1e-9)
        if not runnable or share >= STARVED_SHARE:
            return False
        if log_it and not self._starved_logged:
            self._starved_logged = True
            log.warning(
                "watchdog: no progress for %.1fs, but the engine had %.0f%% of a core with work ready to "
                "run: other processes have the CPU; not hung, waiting",
                waited,
                100 * share,
            )
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
