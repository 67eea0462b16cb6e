"""Whether a tool's parameters schema can constrain its calls: the check both APIs (the gateway's
requests and ``LLM.chat``) make before a tool grammar is built from it."""

from __future__ import annotations


def schema_error(schema) -> str | None:
    """What is wrong with ``schema`` as a tool's parameters (llguidance, which the grammar is built
    with, is the judge), or None."""
    import llguidance

    if not isinstance(schema, dict):
        return "must be a JSON Schema object"
    if schema.get("type", "object") != "object":
        return 'must be a schema of an object ("type": "object")'
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        return f"is not a usable JSON Schema: {str(e).strip()[:300]}"
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return f"is not a usable JSON Schema: {error.strip()[:300]}" if error else None
