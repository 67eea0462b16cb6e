"""Mistral calls: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}`` (v3
tokenizers), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+). Content before the marker."""

from __future__ import annotations

import re
import uuid

from tokenizer_svc.tool_parsers.base import (
    PartialCall,
    ToolParser,
    held_prefix,
    json_call,
    json_rule,
    lark_str,
    more_calls,
    scan_json_value,
    skip_ws,
    text_then_calls,
    tool_schema,
)

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    template_marks = ("[TOOL_CALLS]",)
    needs_special_tokens = True  # [TOOL_CALLS] is a control token of Mistral's vocabularies

    def call_id(self) -> str:
        # Mistral's chat templates refuse a history whose tool_call_id is not 9 letters or digits.
        return uuid.uuid4().hex[:9]

    def pieces(self, text: str, final: bool) -> list[str | PartialCall]:
        i = text.find(MARK)
        if i < 0:
            return [text if final else text[: len(text) - held_prefix(text, MARK)]]
        out: list[str | PartialCall] = [text[:i]]
        pos = skip_ws(text, i + len(MARK))
        if pos >= len(text):
            return out
        if text[pos] == "[":
            return out + self._json_list(text, pos, final)
        return out + self._named(text, pos, final)

    @staticmethod
    def _json_list(text: str, pos: int, final: bool) -> list[str | PartialCall]:
        out: list[str | PartialCall] = []
        pos = skip_ws(text, pos + 1)
        while pos < len(text):
            call, end, complete = json_call(text, pos, final)
            if call is None:
                if complete:  # not a call: the rest is content
                    out.append(text[pos:])
                return out
            out.append(call)
            if not complete:
                return out
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_ws(text, pos + 1)
                continue
            if pos < len(text) and text[pos] == "]":
                out.append(text[pos + 1 :])
                return out
            if pos < len(text):
                out.append(text[pos:])
            return out
        return out

    @staticmethod
    def _named(text: str, pos: int, final: bool) -> list[str | PartialCall]:
        out: list[str | PartialCall] = []
        while pos < len(text):
            m = _NAME.match(text, pos)
            after = m.end() if m is not None else pos
            if m is None or not text.startswith(ARGS, after):
                if not final and m is not None and ARGS.startswith(text[after:]):
                    return out  # the name or its [ARGS] is still coming
                out.append(text[pos:])
                return out
            a = m.end() + len(ARGS)
            end, complete = scan_json_value(text, a, final)
            out.append(PartialCall(m.group(0), text[a:end]))
            if not complete:
                return out
            pos = skip_ws(text, end)
            if text.startswith(MARK, pos):
                pos = skip_ws(text, pos + len(MARK))
            elif not final and MARK.startswith(text[pos:]):
                return out  # the next call's marker may be coming
            elif pos < len(text):
                out.append(text[pos:])
                return out
        return out

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        lines = [
            "start: " + marker(MARK) + ' "[" call' + (more_calls('", "') if parallel else "") + ' "]"',
            "call: " + " | ".join(f"fn{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            head = '{"name": ' + lark_str(tool["function"]["name"]) + ', "arguments": '
            lines.append(f"fn{i}: {lark_str(head)} args{i} " + '"}"')
            lines.append(f"args{i}: {json_rule(tool_schema(tool))}")
        return "\n".join(lines) + "\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, marker) -> str | None:
        rest = '"[" call' + (more_calls('", "') if parallel else "") + ' "]"'
        return text_then_calls(self.grammar(tools, parallel, marker), MARK, marker, rest)
