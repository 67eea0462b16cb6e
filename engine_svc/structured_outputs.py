"""What a request may constrain its output to: a JSON schema, any JSON value, a regular expression,
a choice among strings, or a context-free grammar (Lark, as llguidance reads it). One at a time.

The spec becomes an llguidance grammar string here, and its syntax is checked before the request
is admitted (``ValueError`` naming the field and the library's message). It is compiled against
the model's vocabulary later, off the engine loop (``grammar_compiler.py``). Nothing here is
request text to the engine: it is a constraint, as a stop token id is.
"""

from __future__ import annotations

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
        """The llguidance grammar of this constraint; ``ValueError`` naming the field if it is bad."""
        import llguidance

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
                _check_size(json.dumps(schema), field)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({}, defaults=JSON_DEFAULTS)
            elif kind == "regex":
                _check_str(self.regex, field)
                grammar = llguidance.LLMatcher.grammar_from_regex(self.regex)
            elif kind == "choice":
                choices = list(self.choice)
                if not choices or len(choices) > MAX_CHOICES:
                    raise ValueError(f"between 1 and {MAX_CHOICES} choices")
                for c in choices:
                    _check_str(c, field)
                _check_size("".join(choices), field)
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
                )
            else:
                _check_str(self.grammar, field)
                grammar = llguidance.LLMatcher.grammar_from_lark(self.grammar)
        except ValueError as e:
            raise ValueError(f"{field}: {_first_lines(str(e))}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"{field}: {_first_lines(error)}")
        return grammar


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
