"""Pythonic calls (Llama 3.2 / 4 style): the turn is a Python list of calls with keyword arguments,
``[get_weather(city="Paris"), get_time(zone="CET")]``. A call is read once the list is closed (its
arguments are Python literals, re-written as JSON), so each comes whole. ``true``/``false``/``null``
are read as JSON's, which is what the grammar writes values as."""

from __future__ import annotations

import ast
import json
import re

from tokenizer_svc.tool_parsers.base import (
    PartialCall,
    ToolParser,
    json_rule,
    lark_str,
    more_calls,
    skip_ws,
    text_or_calls,
    tool_schema,
)

_PY_TOKEN = re.compile(r"""'[^'\\\n]*(?:\\.[^'\\\n]*)*'?|"[^"\\\n]*(?:\\.[^"\\\n]*)*"?|[\[\](){}]""")
_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def pieces(self, text: str, final: bool) -> list[str | PartialCall]:
        pos = skip_ws(text, 0)
        if pos >= len(text):
            return [text] if final else []
        if text[pos] != "[":
            return [text]
        end = _list_end(text, pos)
        if end is None:
            return [text] if final else []  # unfinished: held whole (an unclosed list is content)
        calls = _calls(text[pos:end])
        if calls is None:
            return [text]
        return [*calls, text[end:]]

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        lines = [
            'start: "[" call' + (more_calls('", "') if parallel else "") + ' "]"',
            "call: " + " | ".join(f"fn{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            schema = tool_schema(tool)
            props = list((schema.get("properties") or {}).items())
            required = set(schema.get("required") or [])
            items = []
            for j, (key, sub) in enumerate(props):
                lines.append(f"p{i}_{j}: {lark_str(key + '=')} v{i}_{j}")
                lines.append(f"v{i}_{j}: {json_rule(sub if isinstance(sub, dict) else {})}")
                items.append((f"p{i}_{j}", key in required))
            body = _first(items, 0)
            lines.append(f"fn{i}: {lark_str(tool['function']['name'] + '(')} {body} " + '")"')
        return "\n".join(lines) + "\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, marker) -> str | None:
        return text_or_calls(self.grammar(tools, parallel, marker), "[")


def _rest(items, j: int) -> str:
    """Items j.. after at least one was written: each with its comma, the optional ones optional."""
    if j == len(items):
        return ""
    name, req = items[j]
    head = f'", " {name}' if req else f'(", " {name})?'
    return f"{head} {_rest(items, j + 1)}".strip()


def _first(items, j: int) -> str:
    """Items j.. with none written yet: the first one present takes no comma."""
    if j == len(items):
        return ""
    name, req = items[j]
    take = f"{name} {_rest(items, j + 1)}".strip()
    if req:
        return take
    skip = _first(items, j + 1)
    return f"({take} | {skip})" if skip else f"({take})?"


def _list_end(text: str, start: int) -> int | None:
    depth = 0
    for m in _PY_TOKEN.finditer(text, start):
        tok = m.group(0)
        if tok[0] in "'\"":
            body = tok[1:-1]
            if len(tok) < 2 or tok[-1] != tok[0] or (len(body) - len(body.rstrip("\\"))) % 2:
                return None  # the string is still open
            continue
        depth += 1 if tok in "[({" else -1
        if depth == 0:
            return m.end()
    return None


def _calls(source: str) -> list[PartialCall] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    out = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not (name := _dotted(node.func)):
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):
            return None
        out.append(PartialCall(name, json.dumps(args, ensure_ascii=False)))
    return out


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def _literal(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool | type(None)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_literal(k) for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return dict(zip(keys, (_literal(v) for v in node.values), strict=True))
    raise ValueError("not a literal")
