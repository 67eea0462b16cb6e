"""Hermes / Qwen2.5 / Qwen3 calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as many
as the model writes, content before, between and after them."""

from __future__ import annotations

from tokenizer_svc.tool_parsers.base import (
    PartialCall,
    ToolParser,
    held_prefix,
    json_call,
    json_rule,
    lark_str,
    more_calls,
    skip_ws,
    text_then_calls,
    tool_schema,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    template_marks = ("<tool_call>",)

    def pieces(self, text: str, final: bool) -> list[str | PartialCall]:
        out: list[str | PartialCall] = []
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                tail = text[pos:]
                out.append(tail if final else tail[: len(tail) - held_prefix(tail, START)])
                return out
            out.append(text[pos:i])
            j = skip_ws(text, i + len(START))
            close = text.find(END, j)
            body = text[:close] if close >= 0 else text  # the call ends before its end marker
            call, _, _ = json_call(body, j, final or close >= 0)
            if call is not None:
                out.append(call)
            elif close >= 0 or final:  # not a call after all: the block is content, markers included
                out.append(text[i : close + len(END)] if close >= 0 else text[i:])
            if close < 0:
                return out  # unfinished: nothing after it is known yet
            pos = close + len(END)

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        lines = [
            "start: call" + (more_calls('"\\n"') if parallel else ""),
            "call: " + marker(START) + ' "\\n" body "\\n" ' + marker(END),
            "body: " + " | ".join(f"fn{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            head = '{"name": ' + lark_str(tool["function"]["name"]) + ', "arguments": '
            lines.append(f"fn{i}: {lark_str(head)} args{i} " + '"}"')
            lines.append(f"args{i}: {json_rule(tool_schema(tool))}")
        return "\n".join(lines) + "\n"

    def auto_grammar(self, tools: list[dict], parallel: bool, marker) -> str | None:
        rest = '"\\n" body "\\n" ' + marker(END) + (more_calls('"\\n"') if parallel else "")
        return text_then_calls(self.grammar(tools, parallel, marker), START, marker, rest)
