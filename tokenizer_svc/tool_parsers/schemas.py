"""Whether a tool's parameters schema can constrain its calls: the check both APIs (the gateway's
requests and ``LLM.chat``) make before a tool grammar is built from it."""

from __future__ import annotations

import functools
import json


def schema_error(schema) -> str | None:
    """What is wrong with ``schema`` as a tool's parameters (llguidance, which the grammar is built
    with, is the judge), or None. A session sends its tools on every turn: the verdicts on the last
    ``VERDICTS_KEPT`` schemas are kept by their JSON text."""
    if not isinstance(schema, dict):
        return "must be a JSON Schema object"
    if schema.get("type", "object") != "object":
        return 'must be a schema of an object ("type": "object")'
    text = json.dumps(schema)
    return _kept_verdict(text) if len(text) <= KEPT_BYTES else _verdict(text)


VERDICTS_KEPT, KEPT_BYTES = 512, 16 << 10  # at most 8 MiB of schemas held


def _verdict(text: str) -> str | None:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(text))
    except ValueError as e:
        return f"is not a usable JSON Schema: {str(e).strip()[:300]}"
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return f"is not a usable JSON Schema: {error.strip()[:300]}" if error else None


def without_noops(schema):
    """``schema`` less the keywords that cannot change which JSON a tool's call may hold but that the
    grammar engine refuses: ``propertyNames`` that only says a key is a string (every JSON key is;
    Claude Code's tools write it). Everything else is kept, so that ``schema_error`` still names a
    keyword that would really be dropped."""
    if isinstance(schema, list):
        return [without_noops(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "propertyNames" and _any_string(value):
            continue
        out[key] = without_noops(value) if isinstance(value, dict | list) else value
    return out


def _any_string(names) -> bool:
    if names is True or names == {}:
        return True
    if not isinstance(names, dict):
        return False
    rest = {k: v for k, v in names.items() if k not in ("description", "title", "$comment")}
    return rest == {"type": "string"}


_kept_verdict = functools.lru_cache(maxsize=VERDICTS_KEPT)(_verdict)
