"""Tool calls in the forms models write when they do not use their template's markers
(``--tool-call-forms on``): a fenced (```` ```json ````) or bare JSON object
``{"name": ..., "arguments": {...}}`` (or a list of them), or a pythonic call ``get_weather(city="Paris")``
(or a list of them).

``WrittenForms`` wraps the server's parser (``--tool-call-parser``): the calls in the template's
format are read by that parser first; what it leaves as content is read here. Written forms become
calls only when all three hold:

- the reply is nothing but calls: every content run is written forms and blank space (an answer
  with a call after it, or a sentence that shows a call, stays text: Ollama likewise reads calls
  only where the reply opens with one);
- every call names one of the request's tools and its arguments validate against that tool's
  schema (``jsonschema``);
- every call's arguments hold a value the conversation holds (a message's words or a number in
  it; the tools' own descriptions do not count): a call whose every value is the model's own
  (``get_weather(city="Paris")`` for "What is the capital of France?") is a guess, not a request.
  A call with no argument values is not checked.

Anything else -- a JSON example of something else, an unknown name, arguments that fail the schema,
code, prose -- stays text, as it was written. Streamed, text is released as soon as the reply is
known not to be calls alone (its first word or key is no tool's or call's); a reply of forms is held
until it ends, and its calls come whole.
"""

from __future__ import annotations

import ast
import json
import re

from tokenizer_svc.tool_parsers.base import PartialCall, ToolParser, scan_json_value, skip_ws, tool_schema
from tokenizer_svc.tool_parsers.pythonic import _calls as pythonic_calls
from tokenizer_svc.tool_parsers.pythonic import _list_end

FENCE = "```"
# A fence's info string that may hold calls; JSON-only ones do not hold pythonic calls.
_JSON_INFOS = {"json", "tool_call", "tool_calls"}
_PY_INFOS = {"python", "py", "tool_code"}
_KEYS = ("name", "arguments", "parameters")
_CALL_KEYS = ({"name", "arguments"}, {"name", "parameters"})
_FIRST_KEY = re.compile(r'"((?:[^"\\]|\\.)*)("?)')
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_INDENT = re.compile(r"[ \t]*")
WAIT, TEXT, CALLS = "wait", "text", "calls"


class WrittenForms(ToolParser):
    """``base``'s calls, and the written forms of calls of ``tools`` (HF-style dicts) in its content."""

    def __init__(self, base: ToolParser, tools: list[dict], said: list[str]) -> None:
        """``said``: the conversation's texts (the messages' contents and earlier calls' arguments),
        which a written call's arguments must draw on."""
        import jsonschema

        self.base = base
        self._said = Said(said)
        self.name = f"{base.name}+forms"
        self.needs_special_tokens = base.needs_special_tokens
        self._validators = {}
        for tool in tools:
            schema = tool_schema(tool)
            cls = jsonschema.validators.validator_for(schema)
            try:
                cls.check_schema(schema)
            except jsonschema.SchemaError:
                continue  # a schema jsonschema cannot judge: no written call of it is trusted
            self._validators[tool["function"]["name"]] = cls(schema)

    # --- the base parser's part -------------------------------------------------------------------

    def grammar(self, tools, parallel, marker):
        return self.base.grammar(tools, parallel, marker)

    def auto_grammar(self, tools, parallel, marker):
        return self.base.auto_grammar(tools, parallel, marker)

    def call_id(self) -> str:
        return self.base.call_id()

    def pieces(self, text: str, final: bool) -> list[str | PartialCall]:
        """The base's pieces, with its content runs read for written forms. Runs of forms are held
        (and everything after them) until the reply ends: text later in the reply makes them text."""
        base = self.base.pieces(text, final)
        out: list[str | PartialCall] = []
        found: list[list[PartialCall]] = []  # per content run: its calls (None: not a form run)
        for i, piece in enumerate(base):
            if isinstance(piece, PartialCall) or not piece.strip():
                found.append(None)
                continue
            kind, calls = self._run(piece, final or i < len(base) - 1)
            if kind == TEXT:
                return base  # the reply holds text: its written forms are text too
            if kind == WAIT or not final:  # a run of forms, or one that may still be
                return base[:i]
            found.append(calls)
        for piece, calls in zip(base, found, strict=True):
            if calls is None:
                out.append(piece)
            else:
                out += calls
        return out

    # --- the written forms ------------------------------------------------------------------------

    def _run(self, s: str, final: bool) -> tuple[str, list[PartialCall] | None]:
        """One content run: ``(CALLS, calls)`` if it is nothing but forms that are calls, ``(TEXT,
        None)`` if it cannot be, ``(WAIT, None)`` while the text so far cannot tell."""
        calls: list[PartialCall] = []
        pos = skip_ws(s, 0)
        while pos < len(s):
            kind, found, end = self._form(s, pos, final)
            if kind != CALLS:
                return kind, None
            calls += found
            pos = skip_ws(s, end)
        return (CALLS, calls) if final else (WAIT, None)

    def _form(self, s: str, i: int, final: bool) -> tuple[str, list[PartialCall], int]:
        """What the line beginning at ``i`` opens: ``(WAIT, [], i)`` not known yet; ``(TEXT, [],
        end)`` text, scanning goes on from the line holding ``end``; ``(CALLS, calls, end)``."""
        if i >= len(s):
            return (TEXT, [], i) if final else (WAIT, [], i)
        c = s[i]
        if c == "`":
            return self._fence(s, i, final)
        if c in "{[":
            if self._early(s, i, final) == TEXT:
                end = scan_json_value(s, i, final)[0] if c == "{" else (_list_end(s, i) or len(s))
                return TEXT, [], end
            if c == "{":
                end, complete = scan_json_value(s, i, final)
            else:
                end = _list_end(s, i)
                complete = end is not None
            if not complete:
                return (TEXT, [], len(s)) if final else (WAIT, [], i)
            form = s[i:end]
            calls = self._json_calls(form) if c == "{" else self._json_calls(form) or self._py_calls(form)
            return self._closed(s, i, end, calls, final)
        m = _IDENT.match(s, i)
        if m is None:
            return TEXT, [], i
        if self._early(s, i, final) == TEXT:
            return TEXT, [], m.end()
        paren = skip_ws(s, m.end())
        end = _list_end(s, paren)  # the matching ")" (strings skipped)
        if end is None:
            return (TEXT, [], len(s)) if final else (WAIT, [], i)
        return self._closed(s, i, end, self._py_calls(s[i:end]), final)

    def _closed(self, s: str, i: int, end: int, calls, final: bool):
        """A form that ended at ``end``: calls only if the rest of its line is blank."""
        nl = s.find("\n", end)
        rest = s[end:] if nl < 0 else s[end:nl]
        if rest.strip():
            return TEXT, [], end
        if nl < 0 and not final:
            return WAIT, [], i  # more may follow on its line
        return (CALLS, calls, end) if calls else (TEXT, [], end)

    def _fence(self, s: str, i: int, final: bool):
        if not s.startswith(FENCE, i):
            return (WAIT, [], i) if FENCE.startswith(s[i:]) and not final else (TEXT, [], i)
        nl = s.find("\n", i)
        if nl < 0:
            return (WAIT, [], i) if not final else (TEXT, [], len(s))
        info = s[i + len(FENCE) : nl].strip().lower()
        body = nl + 1
        close = _closing_fence(s, body)
        if info not in _JSON_INFOS | _PY_INFOS | {""}:
            return TEXT, [], len(s) if close is None else close + len(FENCE)
        first = skip_ws(s, body)
        if close is None and not final:
            if first >= len(s) or self._early(s, first, False) == WAIT:
                return WAIT, [], i
            return TEXT, [], len(s)  # not a call: the rest of the open fence is text
        inner = s[body:close] if close is not None else s[body:]
        end = close + len(FENCE) if close is not None else len(s)
        start = skip_ws(inner, 0)
        if start >= len(inner) or self._early(inner, start, True) == TEXT:
            return TEXT, [], end
        calls = None
        if info not in _PY_INFOS:
            calls = self._json_calls(inner)
        if calls is None and info not in _JSON_INFOS:
            calls = self._py_calls(inner)
        return (CALLS, calls, end) if calls else (TEXT, [], end)

    def _early(self, s: str, i: int, final: bool) -> str:
        """Whether what begins at ``i`` can still be a call: WAIT (it can), TEXT (it cannot)."""
        pos = i
        if s[pos] == "[":
            pos = skip_ws(s, pos + 1)
            if pos >= len(s):
                return TEXT if final else WAIT
        if s[pos] == "{":
            pos = skip_ws(s, pos + 1)
            if pos >= len(s):
                return TEXT if final else WAIT
            key = _FIRST_KEY.match(s, pos)
            if key is None:
                return TEXT
            name, closed = key.group(1), bool(key.group(2))
            if not closed:
                could = any(k.startswith(name) for k in _KEYS)
                return WAIT if not final and could else TEXT
            if name not in _KEYS:
                return TEXT
            if name == "name":
                colon = skip_ws(s, key.end())
                if colon < len(s) and s[colon] != ":":
                    return TEXT
                value = skip_ws(s, colon + 1)
                if colon >= len(s) or value >= len(s):
                    return TEXT if final else WAIT
                m = _FIRST_KEY.match(s, value)
                if m is None:
                    return TEXT
                if m.group(2):
                    return WAIT if m.group(1) in self._validators else TEXT
                return WAIT if not final and any(n.startswith(m.group(1)) for n in self._validators) else TEXT
            return WAIT
        m = _IDENT.match(s, pos)
        if m is None:
            return TEXT
        ident = m.group(0)
        if m.end() >= len(s) and not final:
            return WAIT if any(n.startswith(ident) for n in self._validators) else TEXT
        if ident not in self._validators:
            return TEXT
        paren = skip_ws(s, m.end())
        if paren >= len(s):
            return TEXT if final else WAIT
        return WAIT if s[paren] == "(" else TEXT

    def _valid(self, name, arguments) -> bool:
        v = self._validators.get(name) if isinstance(name, str) else None
        if v is None or not isinstance(arguments, dict) or not v.is_valid(arguments):
            return False
        values = list(_leaves(arguments))
        return not values or any(self._said.holds(x) for x in values)

    def _json_calls(self, text: str) -> list[PartialCall] | None:
        """A call object, a list of them, or call objects one after another: all valid, or None."""
        dec = json.JSONDecoder()
        objs, pos = [], skip_ws(text, 0)
        try:
            while pos < len(text):
                obj, pos = dec.raw_decode(text, pos)
                objs += obj if isinstance(obj, list) else [obj]
                pos = skip_ws(text, pos)
        except (ValueError, RecursionError):
            return None
        calls = []
        for obj in objs:
            if not isinstance(obj, dict) or set(obj) not in _CALL_KEYS:
                return None
            args = obj.get("arguments", obj.get("parameters"))
            if not self._valid(obj["name"], args):
                return None
            calls.append(PartialCall(obj["name"], json.dumps(args, ensure_ascii=False)))
        return calls or None

    def _py_calls(self, text: str) -> list[PartialCall] | None:
        """Pythonic calls: ``[f(a=1), g(b=2)]`` or one call a statement: all valid, or None."""
        source = text.strip()
        if not source:
            return None
        if not source.startswith("["):
            try:
                tree = ast.parse(source, mode="exec")
            except (SyntaxError, ValueError, RecursionError):
                return None
            parts = []
            for st in tree.body:
                if not isinstance(st, ast.Expr) or not isinstance(st.value, ast.Call):
                    return None
                parts.append(ast.get_source_segment(source, st.value))
            source = "[" + ", ".join(parts) + "]"
        calls = pythonic_calls(source)
        if not calls:
            return None
        for c in calls:
            if not self._valid(c.name, json.loads(c.arguments)):
                return None
        return calls


def _closing_fence(s: str, body: int) -> int | None:
    """Where the fence whose body begins at ``body`` closes (a line that begins with ```)."""
    pos = body
    while pos <= len(s):
        at = _INDENT.match(s, pos).end()
        if s.startswith(FENCE, at):
            return at
        nl = s.find("\n", pos)
        if nl < 0:
            return None
        pos = nl + 1
    return None


_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")


class Said:
    """What the conversation holds, for a written call's arguments to draw on: its words (case
    folded, in order) and its numbers."""

    def __init__(self, texts: list[str]) -> None:
        words, numbers = [], set()
        for text in texts:
            words += [w.casefold() for w in _WORD.findall(text)]
            words.append("")  # a phrase never runs from one message into the next
            numbers.update(float(n.replace(",", "")) for n in _NUMBER.findall(text))
        self._words = " " + " ".join(words) + " "
        self._numbers = numbers

    def holds(self, value) -> bool:
        """A string whose words stand together in one message, or a number written in one."""
        if isinstance(value, bool) or value is None:
            return False
        if isinstance(value, int | float):
            return float(value) in self._numbers
        words = [w.casefold() for w in _WORD.findall(value)]
        return bool(words) and f" {' '.join(words)} " in self._words


def _leaves(value):
    """The scalar values in an arguments object, nested objects and lists included."""
    if isinstance(value, dict):
        for x in value.values():
            yield from _leaves(x)
    elif isinstance(value, list):
        for x in value:
            yield from _leaves(x)
    else:
        yield value
