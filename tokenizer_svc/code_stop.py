"""Where a code completion ends when the client asks: at the end of its line, or of its block.

Editor autocomplete wants the rest of the line, or the rest of the block the cursor is in, not a
page of code after it. Two rules over the streamed text, applied like a stop string (the request
ends there and nothing after it is sent):

- ``line``: the output ends at the first newline that follows non-blank output text (the newline
  is not output). A cursor after ``return `` gets the rest of that line; a cursor at the end of a
  finished line (``def f():``) gets the next line.
- ``block``: the output ends before the first line it begins (after a newline of its own) whose
  first non-blank character is indented less than ``threshold`` spaces or tabs (each counts 1, as
  llama.cpp's ``n_indent`` counts them); the newline and blank lines before that line are not
  output. The threshold is the cursor line's indentation (``cursor_indent``), and at least 1: a
  cursor at the top level gets its statement or definition, up to the next unindented line.

The output's first line continues the cursor's line and is never cut by ``block``. Both rules see
text in any split (a newline's verdict waits for the next line's first non-blank character, so
``block`` holds back a trailing newline and blank lines until then); the same text gives the same
cut however it was streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

LINE, BLOCK = "line", "block"
_BLANK = " \t\r\n\f\v"


def cursor_indent(text_before_cursor: str) -> int:
    """The indentation (spaces and tabs) of the line the cursor is on."""
    line = text_before_cursor[text_before_cursor.rfind("\n") + 1 :]
    return len(line) - len(line.lstrip(" \t"))


def block_threshold(text_before_cursor: str, indent: int | None = None) -> int:
    """The indentation below which a line leaves the cursor's block: ``indent`` when the client
    gives one, else the cursor line's, at least 1."""
    return indent if indent is not None else max(cursor_indent(text_before_cursor), 1)


@dataclass(frozen=True)
class CodeStopStep:
    text: str  # text that may be sent now
    ended: bool  # the rule ended the output with this push


class CodeStop:
    def __init__(self, rule: str, threshold: int = 1) -> None:
        if rule not in (LINE, BLOCK):
            raise ValueError(f"rule must be {LINE!r} or {BLOCK!r}, got {rule!r}")
        self.rule, self.threshold = rule, threshold
        self._seen_text = False  # line: non-blank output so far
        self._held = ""  # block: from the newline after the last non-blank text, on
        self.ended = False

    def push(self, text: str) -> CodeStopStep:
        if self.ended or not text:
            return CodeStopStep("", False)
        if self.rule == LINE:
            return self._line(text)
        return self._block(self._held + text)

    def flush(self) -> str:
        """The output ended otherwise: release what was held back."""
        held, self._held = self._held, ""
        return "" if self.ended else held

    def _line(self, text: str) -> CodeStopStep:
        for i, ch in enumerate(text):
            if ch == "\n" and self._seen_text:
                self.ended = True
                return CodeStopStep(text[:i], True)
            if ch not in _BLANK:
                self._seen_text = True
        return CodeStopStep(text, False)

    def _block(self, buf: str) -> CodeStopStep:
        self._held = ""
        at = 0
        while True:
            newline = buf.find("\n", at)
            if newline < 0:
                return CodeStopStep(buf, False)
            first = newline
            while first < len(buf) and buf[first] in _BLANK:
                first += 1
            if first == len(buf):  # the next line's verdict waits for its first character
                self._held = buf[newline:]
                return CodeStopStep(buf[:newline], False)
            line_start = buf.rfind("\n", newline, first) + 1
            if first - line_start < self.threshold:
                self.ended = True
                return CodeStopStep(buf[:newline], True)
            at = first
