"""A constraint that applies only once the reasoning is over: the grammar lets the model think
freely up to its closing ``</think>`` and constrains what follows. Without this, a JSON schema or a
tool grammar would be imposed on the thinking itself (and a model that must think first could not).
"""

from __future__ import annotations

import json

from engine_svc.structured_outputs import JSON_DEFAULTS, StructuredOutputsParams
from tokenizer_svc.reasoning import CLOSE, OPEN, ReasoningParser
from tokenizer_svc.tool_parsers.base import rust_regex_escape


def answer_rule(so: StructuredOutputsParams) -> str:
    """The constraint as Lark rules whose entry is ``answer``."""
    kind = so.kind()
    if kind in ("json", "json_object"):
        schema = {} if kind == "json_object" else so.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": schema.get("x-guidance", JSON_DEFAULTS)}
        return "answer: %json " + json.dumps(schema, separators=(",", ":")) + "\n"
    if kind == "regex":
        return "answer: /" + so.regex.replace("/", "\\/") + "/\n"
    if kind == "choice":
        return "answer: " + " | ".join(json.dumps(c) for c in dict.fromkeys(so.choice)) + "\n"
    # A whole Lark grammar (a client's, or a tool grammar), nested as a grammar of its own
    # (llguidance's ``%lark {}``): its rule names and directives cannot clash with the thinking's.
    return "answer: %lark {\n" + so.grammar.rstrip("\n") + "\n}\n"


def after_reasoning(so: StructuredOutputsParams, parser: ReasoningParser, marker) -> StructuredOutputsParams:
    """``so`` applied after the reasoning."""
    rule = answer_rule(so)
    close = marker(CLOSE)
    thought = f"THOUGHT: /(?s:.*)/ & ~/(?s:.*{rust_regex_escape(CLOSE)}.*)/"
    if close.startswith("<["):  # a special token: a lexeme of its own
        think = [f"think: THOUGHT? {close} GAP?", thought, "GAP: /[ \\t\\n]+/"]
    else:
        think = ["think: THINK_END", thought, f"THINK_END: THOUGHT {close} /[ \\t\\n]*/"]
    opening = marker(OPEN)
    if parser.starts_in_reasoning:  # deepseek_r1: the prompt opened the thinking; the output may too
        start = f"start: {opening}? think answer"
    else:  # qwen3: thinking only when the output opens it
        start = f"start: {opening} think answer | answer"
    return StructuredOutputsParams(grammar="\n".join([start, *think]) + "\n" + rule)
