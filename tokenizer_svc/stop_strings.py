"""Stop strings over streamed text: emit what is safe, hold back what could still become a stop.

The matcher holds back the longest tail of the text that is a prefix of some stop string. Because
that tail is the longest such, no stop string can begin in text already emitted, so a match is
always found whole inside (held tail + new text), however the text was split into pushes.

The match that ends the text is the one that completes first (smallest end position); of those
ending at the same place, the one that starts earliest. This is the first point at which a stream
can know a stop string occurred, so the result does not depend on how the text was split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    text: str  # text that may be sent now
    matched: str | None  # the stop string that ended the sequence with this push, else None


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a list of strings, not one string")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stops = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        return self._matched

    @property
    def finished(self) -> bool:
        """A stop string has matched; later text is dropped."""
        return self._matched is not None

    def push(self, delta_text: str) -> StopResult:
        if self._matched is not None or not delta_text:
            return StopResult("", None)
        if not self._stops:
            return StopResult(delta_text, None)
        buffer = self._held + delta_text
        match = self._earliest_match(buffer)
        if match is not None:
            start, stop = match
            self._matched = stop
            self._held = ""
            end = start + len(stop) if self._include else start
            return StopResult(buffer[:end], stop)
        hold = self._hold_length(buffer)
        self._held = buffer[len(buffer) - hold :]
        return StopResult(buffer[: len(buffer) - hold], None)

    def flush(self) -> str:
        """The sequence ended without a match: release the held-back tail."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _hold_length(self, buffer: str) -> int:
        for length in range(min(self._max_hold, len(buffer)), 0, -1):
            tail = buffer[len(buffer) - length :]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
