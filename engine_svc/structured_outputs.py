"""What a request may constrain its output to: a JSON schema, any JSON value, a regular expression,
a choice among strings, or a context-free grammar (Lark, as llguidance reads it). One at a time.

The spec becomes an llguidance grammar string here, and its syntax is checked before the request
is admitted (``ValueError`` naming the field and the library's message). It is compiled against
the model's vocabulary later, off the engine loop (``grammar_compiler.py``). Nothing here is
request text to the engine: it is a constraint, as a stop token id is.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

MAX_SPEC_BYTES = 256 << 10  # a schema, regex or grammar larger than this is refused outright
MAX_CHOICES = 1024
# JSON comes out compact: free whitespace lets a model pad forever instead of closing the value. A
# schema can opt back in with "x-guidance": {"whitespace_flexible": true}.
JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (dict, or its JSON text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)
    json_object: bool = False  # any JSON value

    def kind(self) -> str:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: give exactly one of json, regex, choice, grammar, json_object "
                f"(got {', '.join(given) or 'none'})"
            )
        return given[0]

    def to_grammar(self) -> str:
        """The llguidance grammar of this constraint; ``ValueError`` naming the field if it is bad.
        The same spec again (a session's tools on every turn) is built and checked once: the last
        ``GRAMMARS_KEPT`` good ones are kept by their text."""
        kind = self.kind()
        field = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                schema = self.json
                if isinstance(schema, str):
                    _check_size(schema, field)
                    schema = json.loads(schema)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema is an object")
                text = json.dumps(schema)
                _check_size(text, field)
            elif kind == "json_object":
                text = ""
            elif kind == "choice":
                choices = list(self.choice)
                if not choices or len(choices) > MAX_CHOICES:
                    raise ValueError(f"between 1 and {MAX_CHOICES} choices")
                for c in choices:
                    _check_str(c, field)
                _check_size("".join(choices), field)
                text = "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
            else:
                text = self.regex if kind == "regex" else self.grammar
                _check_str(text, field)
            return _kept_grammar(kind, text) if len(text) <= KEPT_BYTES else _grammar(kind, text)
        except ValueError as e:
            raise ValueError(f"{field}: {_first_lines(str(e))}") from None


GRAMMARS_KEPT, KEPT_BYTES = 64, 128 << 10  # at most 64 specs of up to 128 KiB kept, with their grammars


def _grammar(kind: str, text: str) -> str:
    """The grammar of a spec's text (a JSON schema's JSON, a regex, Lark), syntax-checked; a bad one
    raises ``ValueError`` (not kept)."""
    import llguidance

    if kind == "json":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_DEFAULTS)
    elif kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({}, defaults=JSON_DEFAULTS)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(text)
    else:  # "choice" (written as Lark above) and "grammar"
        grammar = llguidance.LLMatcher.grammar_from_lark(text)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


_kept_grammar = functools.lru_cache(maxsize=GRAMMARS_KEPT)(_grammar)


def _check_str(value, field: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    _check_size(value, field)


def _check_size(text: str, field: str) -> None:
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise ValueError(f"is over {MAX_SPEC_BYTES} bytes")


def _first_lines(message: str, limit: int = 400) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + "..."
