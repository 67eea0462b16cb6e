"""Llama 3.1+ JSON calls: the whole turn is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``), several separated by ``;``. An output that does not open with ``{`` is content."""

from __future__ import annotations

from tokenizer_svc.tool_parsers.base import (
    PartialCall,
    ToolParser,
    json_call,
    json_rule,
    lark_str,
    more_calls,
    skip_ws,
    text_or_calls,
    tool_schema,
)

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|>
    template_marks = ("ipython",)  # Llama 3.1+: "Environment: ipython", tool results as role ipython

    def pieces(self, text: str, final: bool) -> list[str | PartialCall]:
        pos = skip_ws(text, 0)
        if not final and TAG.startswith(text[pos:]):
            return []  # nothing yet, or the tag's beginning: not known
        if text.startswith(TAG, pos):
            pos = skip_ws(text, pos + len(TAG))
            if pos >= len(text):
                return []
        if pos >= len(text) or text[pos] != "{":
            return [text]
        out: list[str | PartialCall] = []
        while True:
            call, end, complete = json_call(text, pos, final)
            if call is None:
                if complete:  # not a call: content from here (all of it, if it is the first object)
                    out.append(text[pos:] if out else text)
                return out
            out.append(call)
            if not complete:
                return out
            semi = skip_ws(text, end)
            if semi < len(text) and text[semi] == ";":
                after = skip_ws(text, semi + 1)
                if after < len(text) and text[after] == "{":
                    pos = after
                    continue
                if after >= len(text) and not final:
                    return out  # a next call may follow
                out.append(text[semi + 1 :])
                return out
            out.append(text[end:])
            return out

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        lines = [
            "start: call" + (more_calls('"; "') if parallel else ""),
            "call: " + " | ".join(f"fn{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            head = '{"name": ' + lark_str(tool["function"]["name"]) + ', "parameters": '
            lines.append(f"fn{i}: {lark_str(head)} args{i} " + '"}"')
            lines.append(f"args{i}: {json_rule(tool_schema(tool))}")
        return "\n".join(lines) + "\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, marker) -> str | None:
        return text_or_calls(self.grammar(tools, parallel, marker), "{")
