"""Chat messages and tools in Hugging Face's chat-template convention, checked, and to and from the
tokenizer workers' protobuf.

The convention (what ``apply_chat_template(messages, tools=...)`` templates read):

- a message is ``{"role", "content"}``; ``content`` may be ``None`` for an assistant turn that only
  calls tools, which then has ``"tool_calls": [{"id", "type": "function", "function": {"name",
  "arguments": {...}}}]`` (arguments as a dict: templates write them with ``tojson``); a tool's
  answer is ``{"role": "tool", "content", "tool_call_id"}`` (and optionally ``"name"``);
- a tool is ``{"type": "function", "function": {"name", "description", "parameters": {schema}}}``.

Between processes the arguments and schemas travel as JSON text inside protobuf fields.
"""

from __future__ import annotations

import json

from llmserve_proto.tokenizer.v1 import tokenizer_pb2 as pb


def validate_messages(messages: object) -> list[dict]:
    """Check chat messages before a template sees them; ``ValueError`` naming the message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {i} is {type(message).__name__}, expected a dict")
        if "role" not in message:
            raise ValueError(f"chat message {i} has no 'role'")
        if not isinstance(message["role"], str):
            raise ValueError(f"chat message {i}: 'role' must be a string")
        calls = message.get("tool_calls")
        if calls is not None:
            _check_calls(i, calls)
        content = message.get("content")
        if "content" not in message and not calls:
            raise ValueError(f"chat message {i} has no 'content'")
        if content is None and not calls and "content" in message:
            raise ValueError(f"chat message {i}: 'content' must be a string")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"chat message {i}: 'content' must be a string")
        for key in ("tool_call_id", "name"):
            if key in message and not isinstance(message[key], str):
                raise ValueError(f"chat message {i}: '{key}' must be a string")
    return messages


def _check_calls(i: int, calls) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"chat message {i}: 'tool_calls' must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"chat message {i}: tool_calls[{j}] must be {{'function': {{'name', 'arguments'}}}}"
            )
        if not isinstance(fn.get("arguments", {}), dict):
            raise ValueError(f"chat message {i}: tool_calls[{j}].function.arguments must be a dict")


def validate_tools(tools: object) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}} dicts")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}")
    return tools


def to_proto(messages: list[dict], tools: list[dict] | None) -> tuple[list[pb.ChatMessage], list[pb.Tool]]:
    out = []
    for m in messages:
        msg = pb.ChatMessage(
            role=m["role"], tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or ""
        )
        if m.get("content") is not None:
            msg.content = m["content"]
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            msg.tool_calls.add(
                id=call.get("id") or "", name=fn["name"], arguments_json=json.dumps(fn.get("arguments", {}))
            )
        out.append(msg)
    pb_tools = []
    for t in tools or []:
        fn = t["function"]
        params = fn.get("parameters")
        pb_tools.append(
            pb.Tool(
                name=fn["name"],
                description=fn.get("description") or "",
                parameters_json="" if params is None else json.dumps(params),
            )
        )
    return out, pb_tools


def from_proto(request: pb.ChatRequest) -> tuple[list[dict], list[dict] | None]:
    """The dicts ``to_proto`` was given (JSON text back to dicts; ``ValueError`` if it is not JSON)."""
    messages = []
    for m in request.messages:
        d: dict = {"role": m.role, "content": m.content if m.HasField("content") else None}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _json(c.arguments_json, "arguments")},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        messages.append(d)
    if not request.tools:
        return messages, None
    tools = []
    for t in request.tools:
        fn: dict = {"name": t.name, "description": t.description}
        if t.parameters_json:
            fn["parameters"] = _json(t.parameters_json, "parameters")
        tools.append({"type": "function", "function": fn})
    return messages, tools


def _json(text: str, what: str):
    try:
        return json.loads(text) if text else {}
    except ValueError:
        raise ValueError(f"tool call {what} are not JSON") from None
