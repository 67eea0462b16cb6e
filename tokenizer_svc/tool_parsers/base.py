"""The one interface every tool-call parser has, and the streaming that all of them share.

A parser says what a (possibly unfinished) output text holds so far: ``snapshot(text, final)`` is the
ordered pieces of content and calls that are certain at this point. Certain means a later, longer
text never takes them back: content is only ever extended, a call's name never changes, and its
arguments' JSON text is only ever extended. Text that may still turn out to be a marker is held
back until it is known (``final=True``: the text is complete, nothing is held).

The whole-text parse is ``snapshot(text, final=True)``; streaming (``ToolCallStream``) takes a new
snapshot per delta and sends only what it adds, so the deltas joined are the whole-text parse
whatever the chunk boundaries. A parser that broke the rule would be caught here (``RuntimeError``)
and by the tests that cut a text at every character.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class PartialCall:
    name: str
    arguments: str  # JSON text of the arguments object so far (the whole of it once complete)


@dataclass
class Snapshot:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall]


@dataclass
class CallDelta:
    index: int
    name: str | None  # set on the call's first delta only
    arguments: str  # the next piece of its arguments' JSON text


@dataclass
class OutputDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


# The most calls one output may hold where the grammar writes them (required / named / auto): the
# list closes after this many, so a model that would call and call until its token limit ends with
# whole calls instead of a cut one (as many as an agent's one turn sensibly makes at once).
MAX_PARALLEL_CALLS = 8


def more_calls(sep: str, call: str = "call") -> str:
    """The grammar of the calls after the first: up to MAX_PARALLEL_CALLS - 1, each after ``sep``."""
    return f" ({sep} {call}){{0,{MAX_PARALLEL_CALLS - 1}}}"


def whole_object(arguments: str) -> bool:
    """Whether a call's arguments are a whole JSON object: a call that is not (cut short by the token
    limit, or the text ended inside it) is never returned as a call."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class ToolParser(ABC):
    name: ClassVar[str]
    # The format's markers are special tokens in its models' vocabularies: the output must be
    # detokenized with them (skip_special_tokens off) for the parser to see them.
    needs_special_tokens: ClassVar[bool] = False
    # Strings a chat template writes when it offers this format to the model: the server takes
    # the parser whose marks the served template holds (``--tool-call-parser auto``, the default).
    # Empty: never chosen that way (a format a template cannot be told by).
    template_marks: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def pieces(self, text: str, final: bool) -> list[str | PartialCall]:
        """The content runs and calls of ``text`` in order (content held back where not certain)."""

    @abstractmethod
    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        """A Lark grammar (llguidance's dialect) of one or more calls of ``tools`` (HF-style dicts:
        ``{"function": {"name", "parameters"}}``) in this format; one call when not ``parallel``.
        ``marker(s)``: the grammar for a marker string (a special token where the vocabulary has it)."""

    def auto_grammar(self, tools: list[dict], parallel: bool, marker) -> str | None:
        """A Lark grammar of "free text, or well-formed calls" (``tool_choice: auto``): text that
        could begin a call must be one. None: the format cannot say (the output is unconstrained)."""
        return None

    def call_id(self) -> str:
        """A new call's id, in OpenAI's shape unless the format's chat templates check another
        (the id comes back as a history's ``tool_call_id``)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return assemble(self.pieces(text, final), final)

    def parse(self, text: str) -> ParsedOutput:
        snap = self.snapshot(text, True)
        return ParsedOutput(snap.content, [ToolCall(c.name, c.arguments) for c in snap.calls])


def assemble(pieces: list[str | PartialCall], final: bool) -> Snapshot:
    """Pieces to a snapshot: content runs joined, whitespace next to calls dropped (the newline a
    model writes between two calls is not content). The last run's trailing whitespace is held
    back while the text is unfinished, since a call after it would drop it."""
    merged: list[str | PartialCall] = []
    for piece in pieces:  # adjacent runs are one run
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    pieces = merged
    content: list[str] = []
    calls: list[PartialCall] = []
    last = len(pieces) - 1
    for i, piece in enumerate(pieces):
        if isinstance(piece, PartialCall):
            calls.append(piece)
            continue
        text = piece
        if i > 0 and isinstance(pieces[i - 1], PartialCall):
            text = text.lstrip()
        if (i < last and isinstance(pieces[i + 1], PartialCall)) or (i == last and not final):
            text = text.rstrip()
        content.append(text)
    return Snapshot("".join(content), calls)


class ToolCallStream:
    """One sequence's output, delta by delta, as content and call pieces."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content = ""
        self._calls: list[PartialCall] = []

    def feed(self, delta: str) -> OutputDelta:
        self.text += delta
        return self._diff(self.parser.snapshot(self.text, False))

    def finish(self) -> OutputDelta:
        return self._diff(self.parser.snapshot(self.text, True))

    def _diff(self, snap: Snapshot) -> OutputDelta:
        if not snap.content.startswith(self._content):
            raise RuntimeError(f"tool parser {self.parser.name} took back content")
        out = OutputDelta(content=snap.content[len(self._content) :])
        self._content = snap.content
        if len(snap.calls) < len(self._calls):
            raise RuntimeError(f"tool parser {self.parser.name} took back a call")
        for i, call in enumerate(snap.calls):
            if i < len(self._calls):
                old = self._calls[i]
                if call.name != old.name or not call.arguments.startswith(old.arguments):
                    raise RuntimeError(f"tool parser {self.parser.name} changed call {i}")
                if len(call.arguments) > len(old.arguments):
                    out.calls.append(CallDelta(i, None, call.arguments[len(old.arguments) :]))
            else:
                out.calls.append(CallDelta(i, call.name, call.arguments))
        self._calls = [PartialCall(c.name, c.arguments) for c in snap.calls]
        return out


# --- helpers the formats share ---------------------------------------------------------------------

# Strings as an unrolled loop (one character class run per step, not an alternation per character).
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[{}\[\]]')
_JSON_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_WS = re.compile(r"\s*")


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (held back:
    the next delta may complete the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def scan_json_value(text: str, start: int, final: bool) -> tuple[int, bool]:
    """Where the JSON value at ``start`` ends: ``(end, complete)``. Objects and arrays end at their
    matching bracket (strings skipped); an unfinished one runs to the end of ``text``."""
    if start >= len(text):
        return start, False
    if text[start] in "{[":
        depth = 0
        for m in _JSON_TOKEN.finditer(text, start):
            tok = m.group(0)
            if tok[0] == '"':
                if len(tok) < 2 or not _closed_string(tok):
                    return len(text), False
                continue
            depth += 1 if tok in "{[" else -1
            if depth == 0:
                return m.end(), True
        return len(text), False
    if text[start] == '"':
        m = _JSON_TOKEN.match(text, start)
        tok = m.group(0)
        return (m.end(), True) if len(tok) >= 2 and _closed_string(tok) else (len(text), False)
    m = _JSON_SCALAR.match(text, start)
    if m is None:
        return start, False
    if m.end() == len(text) and not final:
        return start, False  # a number may go on
    return m.end(), True


def _closed_string(tok: str) -> bool:
    # '"abc\\"' is closed; '"abc\"' is not (its last quote is escaped).
    body = tok[1:-1] if tok.endswith('"') else None
    if body is None:
        return False
    backslashes = len(body) - len(body.rstrip("\\"))
    return backslashes % 2 == 0


_HEADER = re.compile(r'\{\s*"name"\s*:\s*("[^"\\]*(?:\\.[^"\\]*)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_call(text: str, pos: int, final: bool) -> tuple[PartialCall | None, int, bool]:
    """A ``{"name": ..., "arguments"|"parameters": {...}}`` object at ``pos``:
    ``(call or None, end, complete)``. The call is known once its name and the start of its
    arguments are; its arguments grow until the object closes. Other key orders are read once the
    object is complete (their arguments re-serialized). None and incomplete: not known yet."""
    m = _HEADER.match(text, pos)
    if m is not None:
        try:
            name = json.loads(m.group(1))
        except ValueError:
            name = None
        if isinstance(name, str):
            a = m.end()
            end, complete = scan_json_value(text, a, final)
            call = PartialCall(name, text[a:end])
            if not complete:
                return call, len(text), False
            close = skip_ws(text, end)
            if close < len(text) and text[close] == "}":
                return call, close + 1, True
            outer, ok = scan_json_value(text, pos, final)  # extra keys after the arguments
            return call, outer, ok
    end, complete = scan_json_value(text, pos, final)
    if not complete:
        return None, end, False
    try:
        obj = json.loads(text[pos:end])
    except ValueError:
        return None, end, True
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, dict):
            return PartialCall(obj["name"], json.dumps(args, ensure_ascii=False)), end, True
    return None, end, True


def tool_schema(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def lark_str(s: str) -> str:
    return json.dumps(s)


def json_rule(schema: dict) -> str:
    """A rule body for a JSON value of ``schema``, written compact (free whitespace would let a
    model pad forever instead of closing the value), unless the schema opts in with x-guidance."""
    schema = {**schema, "x-guidance": schema.get("x-guidance", {"whitespace_flexible": False})}
    return "%json " + json.dumps(schema, separators=(",", ":"))


def rust_regex_escape(s: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in s)


def text_then_calls(calls_grammar: str, mark: str, marker, rest: str) -> str:
    """``start: free text | text, then the marker, then ``rest`` (the calls after their first
    marker)``; the text never holds the marker. A marker that is a plain string is one lexeme with
    the text before it (llguidance's lexer cannot end a free-text lexeme where a literal begins)."""
    lines = calls_grammar.splitlines()[1:]  # the grammar's own start rule is replaced
    m = marker(mark)
    text = f"TEXT: /(?s:.*)/ & ~/(?s:.*{rust_regex_escape(mark)}.*)/"
    if m.startswith("<["):  # a special token: a lexeme of its own
        head = [f"start: TEXT | TEXT? {m} {rest}", text]
    else:
        head = [f"start: TEXT | OPEN {rest}", text, f"OPEN: TEXT {m}"]
    return "\n".join(head + lines) + "\n"


def text_or_calls(calls_grammar: str, opener: str) -> str:
    """``start: free text that does not open with ``opener`` | the calls`` (formats whose calls
    are the whole output)."""
    lines = calls_grammar.splitlines()
    calls = lines[0].removeprefix("start:").strip()
    text = f"TEXT: /(?s:.*)/ & ~/(?s:\\s*{rust_regex_escape(opener)}.*)/"
    return "\n".join([f"start: TEXT | {calls}", text, *lines[1:]]) + "\n"
