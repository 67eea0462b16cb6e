"""A chat request's tools and history of calls, checked, and what they mean for generation: the
messages and tools as the chat template reads them, which parser reads the output, and the grammar
that makes a required or named call always parse.

Both APIs come through here (HTTP after its JSON became the proto), so a bad tool is refused with
the same words on either. Field names are the proto's (``chat.tools[0].parameters``); the HTTP API
names its own fields by passing ``names``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import FieldViolation
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tokenizer_svc.tool_parsers import ToolParser, get_parser
from tokenizer_svc.tool_parsers.schemas import schema_error, without_noops
from tokenizer_svc.tool_parsers.written_forms import WrittenForms

MAX_TOOLS = 128

log = logging.getLogger("gateway.tools")


AUTO = "auto"


@dataclass(frozen=True)
class ToolOptions:
    """The server's tool-calling settings (``llmserve serve`` flags, vLLM's names).

    ``tool_call_parser`` "auto" and ``enable_auto_tool_choice`` None (``serve``'s defaults) are
    settled by ``for_template`` once the chat template is known: the parser whose format the
    template offers, and tool_choice "auto" on where there is one -- as llama-server and Ollama
    do, with no flag (vLLM asks for both)."""

    enable_auto_tool_choice: bool | None = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # --tool-call-forms: with tool_choice "auto", calls the model wrote in a form its template does
    # not ask for (fenced or bare JSON, pythonic) are read as calls too (tool_parsers/written_forms.py)
    tool_call_forms: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, AUTO):
            get_parser(self.tool_call_parser)  # ValueError with the list of names
        if self.reasoning_parser is not None:
            from tokenizer_svc.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_forms and self.enable_auto_tool_choice is False:
            raise ValueError(
                "--tool-call-forms on needs --enable-auto-tool-choice (it reads tool_choice auto's output)"
            )

    def for_template(self, template: str) -> ToolOptions:
        """These options with "auto" and None settled for a chat template's text (empty: none)."""
        from tokenizer_svc.tool_parsers import PARSERS, parser_for_template

        parser = self.tool_call_parser
        if parser == AUTO:
            parser = parser_for_template(template)
            if parser is None and self.enable_auto_tool_choice:
                raise ValueError(
                    "--enable-auto-tool-choice: the model's chat template writes no tool-call format this "
                    "server knows (" + ", ".join(sorted(PARSERS)) + "); name one with --tool-call-parser"
                )
        auto = self.enable_auto_tool_choice
        if auto is None:
            auto = parser is not None
        return ToolOptions(auto, parser, self.reasoning_parser, self.tool_call_forms and auto)


@dataclass
class Names:
    """How violations name a field: the proto's paths, or the HTTP API's."""

    tools: Callable[[int, str], str] = lambda i, f: f"chat.tools[{i}].{f}"
    tool_list: str = "chat.tools"
    tool_choice: str = "chat.tool_choice"
    message: Callable[[int, str], str] = lambda i, f: f"chat.messages[{i}].{f}"


HTTP_NAMES = Names(
    tools=lambda i, f: f"tools[{i}].function.{f}",
    tool_list="tools",
    tool_choice="tool_choice",
    message=lambda i, f: f"messages[{i}].{f}",
)


@dataclass
class ToolPlan:
    tools: list[dict] | None  # HF-style dicts for the template; None: no tools
    parser: ToolParser | None  # None: the output is content only (no tools, or tool_choice none)
    grammar: str | None = None  # required / named: the output is calls of these tools
    forced: bool = False
    violations: list[FieldViolation] = field(default_factory=list)


def chat_messages(messages, names: Names, bad: Callable[[str, str], None]) -> list[dict]:
    """The proto's messages as the template reads them (a call's arguments as a dict)."""
    out = []
    for i, m in enumerate(messages):
        d: dict = {"role": m.role, "content": m.content if m.HasField("content") else None}
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.arguments) if c.arguments else {}
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    bad(
                        names.message(i, f"tool_calls[{j}].function.arguments"),
                        "must be a JSON object as text",
                    )
                    args = {}
                if not c.name:
                    bad(names.message(i, f"tool_calls[{j}].function.name"), "must not be empty")
                calls.append(
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}
                )
            d["tool_calls"] = calls
        elif not m.HasField("content"):
            bad(names.message(i, "content"), "is required (it may be null only with tool_calls)")
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def plan_tools(
    chat: pb.Chat, options: ToolOptions, has_constraint: bool, marker, names: Names | None = None
) -> ToolPlan:
    """Check the tools and the choice against each other and the server's settings; the plan's
    ``violations`` say what is wrong (empty: nothing)."""
    names = names or Names()
    v: list[FieldViolation] = []

    def bad(f: str, why: str) -> None:
        v.append(FieldViolation(f, why))

    tools: list[dict] = []
    # A schema the grammar engine cannot use in full (a keyword it lacks) refuses only a request
    # whose calls need that tool's grammar (required / named); the template still sees it as sent.
    unusable: dict[int, str] = {}
    grammar_schemas: dict[int, dict] = {}
    if len(chat.tools) > MAX_TOOLS:
        bad(names.tool_list, f"at most {MAX_TOOLS} tools, got {len(chat.tools)}")
    seen: set[str] = set()
    for i, t in enumerate(chat.tools[:MAX_TOOLS]):
        if not t.name or len(t.name) > 256 or not t.name.isprintable():
            bad(names.tools(i, "name"), "must be 1 to 256 printable characters")
        elif t.name in seen:
            bad(names.tools(i, "name"), f"{t.name!r} is given twice")
        seen.add(t.name)
        fn: dict = {"name": t.name, "description": t.description}
        if t.parameters:
            schema = _schema(t.parameters)
            if schema is None:
                bad(names.tools(i, "parameters"), "must be a JSON Schema object")
            else:
                grammar_schemas[i] = without_noops(schema)
                why = schema_error(grammar_schemas[i])
                if why and "Unimplemented keys" in why:  # valid, but the grammar engine lacks a keyword
                    unusable[i] = why
                elif why:
                    bad(names.tools(i, "parameters"), why)
                fn["parameters"] = schema
        tools.append({"type": "function", "function": fn})

    kind = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    mode = chat.tool_choice.mode if kind == "mode" else None
    if kind is not None and not tools and not (kind == "mode" and mode == pb.ToolChoice.MODE_NONE):
        bad(names.tool_choice, "needs tools")
    plan = ToolPlan(tools or None, None, violations=v)
    if not tools or v:
        return plan
    if kind is None:
        mode = pb.ToolChoice.MODE_AUTO
    if kind == "mode" and mode == pb.ToolChoice.MODE_NONE:
        return plan
    parser = get_parser(options.tool_call_parser) if options.tool_call_parser else None
    if kind == "mode" or kind is None:
        if mode == pb.ToolChoice.MODE_AUTO:
            if parser is None:
                bad(
                    names.tool_choice,
                    '"auto" needs a tool-call parser: the served chat template writes no call format this '
                    "server knows; start it with --tool-call-parser (hermes, llama3_json, mistral, pythonic)",
                )
                return plan
            if not options.enable_auto_tool_choice:
                bad(
                    names.tool_choice,
                    '"auto" is off on this server (started with --no-enable-auto-tool-choice)',
                )
                return plan
            if options.tool_call_forms:  # a written call must draw on what the conversation says
                said = [m.content for m in chat.messages if m.HasField("content")]
                said += [c.arguments for m in chat.messages for c in m.tool_calls]
                plan.parser = WrittenForms(parser, tools, said)
            else:
                plan.parser = parser
            if not has_constraint:  # free text or well-formed calls (where the format can say)
                parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
                for i, why in unusable.items():  # its calls are still JSON objects, just not checked
                    log.info("tool %d's schema is not enforced in the auto grammar: %s", i, why)
                lax = {i: {"type": "object"} for i in unusable}
                plan.grammar = parser.auto_grammar(
                    _for_grammar(tools, grammar_schemas, lax), parallel, marker
                )
            return plan
        chosen = list(range(len(tools)))  # required
    else:
        chosen = [i for i, t in enumerate(tools) if t["function"]["name"] == chat.tool_choice.function]
        if not chosen:
            bad(
                names.tool_choice,
                f"names the function {chat.tool_choice.function!r}, which is not among the tools",
            )
            return plan
    if parser is None:
        bad(names.tool_choice, "a required or named call needs the server started with --tool-call-parser")
        return plan
    if has_constraint:
        bad(names.tool_choice, "a required or named call cannot be combined with response_format")
        return plan
    for i in chosen:
        if i in unusable:
            bad(names.tools(i, "parameters"), unusable[i] + " (a required or named call is built from it)")
    if v:
        return plan
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    plan.parser = parser
    plan.forced = True
    grammar_tools = _for_grammar(tools, grammar_schemas, {})
    plan.grammar = parser.grammar([grammar_tools[i] for i in chosen], parallel and kind != "function", marker)
    return plan


def _for_grammar(tools: list[dict], schemas: dict[int, dict], lax: dict[int, dict]) -> list[dict]:
    """The tools as their grammar is built: each schema less its no-op keywords (``lax``: in place
    of the schemas the grammar engine cannot use)."""
    out = []
    for i, t in enumerate(tools):
        fn = dict(t["function"])
        if i in schemas:
            fn["parameters"] = lax.get(i, schemas[i])
        out.append({"type": "function", "function": fn})
    return out


def _schema(text: str) -> dict | None:
    try:
        schema = json.loads(text)
    except ValueError:
        return None
    return schema if isinstance(schema, dict) else None
