"""Tool-call parsers by name (``--tool-call-parser``): one module per model family's call format."""

from __future__ import annotations

from tokenizer_svc.tool_parsers.base import (
    CallDelta,
    OutputDelta,
    ParsedOutput,
    PartialCall,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from tokenizer_svc.tool_parsers.hermes import HermesToolParser
from tokenizer_svc.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenizer_svc.tool_parsers.mistral import MistralToolParser
from tokenizer_svc.tool_parsers.pythonic import PythonicToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}

__all__ = [
    "PARSERS",
    "CallDelta",
    "OutputDelta",
    "ParsedOutput",
    "PartialCall",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_parser",
    "parser_for_template",
]


def parser_for_template(template: str) -> str | None:
    """The name of the parser whose call format ``template`` (a chat template's text) offers the
    model, by each parser's declared ``template_marks``; None where it offers none we know."""
    for name, cls in PARSERS.items():
        if any(mark in template for mark in cls.template_marks):
            return name
    return None


def get_parser(name: str) -> ToolParser:
    """The parser called ``name``; ``ValueError`` listing the known names otherwise."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return cls()
