"""``LLM.chat``'s tool calling and reasoning: the same parsers and grammars the gateway serves with
(``tokenizer_svc.tool_parsers``, ``tokenizer_svc.reasoning``), applied to an offline chat.

Before generating, ``plan_chat`` checks the tools and the choice (``ValueError`` naming the argument)
and gives each conversation's sampling parameters the grammar that makes a required or named call
always parse (or, for ``auto``, free text or a well-formed call), deferred past the reasoning where a
reasoning parser is set. After, ``split_output`` takes the reasoning and the calls out of the text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine_svc.outputs import CompletionOutput, ToolCallOutput
from engine_svc.sampling_params import SamplingParams
from engine_svc.structured_outputs import StructuredOutputsParams
from tokenizer_svc.reasoning import ReasoningParser
from tokenizer_svc.reasoning_grammar import after_reasoning
from tokenizer_svc.tool_parsers import ToolParser
from tokenizer_svc.tool_parsers.base import whole_object
from tokenizer_svc.tool_parsers.markers import marker_for
from tokenizer_svc.tool_parsers.schemas import schema_error, without_noops

MODES = ("none", "auto", "required")


@dataclass
class ChatPlan:
    params: SamplingParams  # the caller's, with the grammar (and special tokens kept) where needed
    tool_parser: ToolParser | None  # None: the text holds no calls to read
    reasoning_parser: ReasoningParser | None


def check_tools(tools) -> list[dict] | None:
    """``tools`` in HF's convention, checked as the gateway checks a request's (the same schema
    judge); ``ValueError`` naming the entry."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}} dicts")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name', ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
            raise ValueError(f"tools[{i}].function.name: must be 1 to 256 printable characters")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name: {name!r} is given twice")
        seen.add(name)
        if fn.get("parameters") is not None:
            why = schema_error(without_noops(fn["parameters"]))
            if why:
                raise ValueError(f"tools[{i}].function.parameters: {why}")
    return tools or None


def _named(tool_choice) -> str | None:
    """The function a named choice names; ``ValueError`` for a choice of no known shape."""
    if tool_choice is None or (isinstance(tool_choice, str) and tool_choice in MODES):
        return None
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(
            "tool_choice: must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    return name


def plan_chat(
    params: SamplingParams,
    tools: list[dict] | None,
    tool_choice,
    parallel_tool_calls: bool,
    tool_parser: ToolParser | None,
    reasoning_parser: ReasoningParser | None,
    tokenizer,
) -> ChatPlan:
    """What one conversation is decoded under, and what reads its output."""
    named = _named(tool_choice)
    if tool_choice is not None and tool_choice != "none" and not tools:
        raise ValueError("tool_choice: needs tools")
    marker = marker_for(tokenizer)
    grammar, parser = None, None
    mode = "auto" if tool_choice is None else tool_choice
    if tools and mode != "none":
        if named is not None:
            chosen = [t for t in tools if t["function"]["name"] == named]
            if not chosen:
                raise ValueError(f"tool_choice: names the function {named!r}, which is not among the tools")
        else:
            chosen = tools
        if mode == "auto":
            # Without a parser the text is the raw reply (the template rendered the tools; nothing
            # reads calls out of it), as before tool parsing existed offline.
            parser = tool_parser
            if parser is not None and params.structured_outputs is None:
                grammar = parser.auto_grammar(_for_grammar(tools), parallel_tool_calls, marker)
        else:
            if tool_parser is None:
                raise ValueError("tool_choice: a required or named call needs LLM(..., tool_call_parser=...)")
            if params.structured_outputs is not None:
                raise ValueError(
                    "tool_choice: a required or named call cannot be combined with structured_outputs"
                )
            parser = tool_parser
            grammar = parser.grammar(_for_grammar(chosen), parallel_tool_calls and named is None, marker)
    changes: dict = {}
    if grammar is not None:
        changes["structured_outputs"] = StructuredOutputsParams(grammar=grammar)
    if parser is not None and parser.needs_special_tokens:
        changes["skip_special_tokens"] = False  # the format's markers are special tokens
    constraint = changes.get("structured_outputs", params.structured_outputs)
    if reasoning_parser is not None and constraint is not None:  # never inside the thinking
        changes["structured_outputs"] = after_reasoning(constraint, reasoning_parser, marker)
    if changes:
        params = dataclasses.replace(params, **changes)
    return ChatPlan(params, parser, reasoning_parser)


def _for_grammar(tools: list[dict]) -> list[dict]:
    """The tools as their grammar is built: schemas less the keywords that constrain nothing."""
    out = []
    for t in tools:
        fn = dict(t["function"])
        if isinstance(fn.get("parameters"), dict):
            fn["parameters"] = without_noops(fn["parameters"])
        out.append({**t, "function": fn})
    return out


def split_output(out: CompletionOutput, plan: ChatPlan) -> None:
    """``out.text`` becomes the reply's content; its reasoning goes to ``reasoning_content`` and
    its calls to ``tool_calls`` (a reply that ended normally after calling finishes "tool_calls")."""
    text = out.text
    if plan.reasoning_parser is not None:
        split = plan.reasoning_parser.split(text, True)
        out.reasoning_content, text = split.reasoning, split.content
    if plan.tool_parser is not None:
        parsed = plan.tool_parser.parse(text)
        text = parsed.content
        out.tool_calls = [  # a call cut short (the token limit) is not a call
            ToolCallOutput(plan.tool_parser.call_id(), c.name, c.arguments)
            for c in parsed.calls
            if whole_object(c.arguments)
        ]
        if out.tool_calls and out.finish_reason == "stop":
            out.finish_reason = "tool_calls"
    out.text = text
