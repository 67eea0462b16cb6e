"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): what Claude Code
and the ``anthropic`` SDKs speak, as a translation onto the one generation path.

A body becomes the chat ``GenerateRequest`` the chat completions route would make (system prompt and
``system`` messages, text / ``tool_use`` / ``tool_result`` blocks as chat messages with tool calls and
tool results, ``tools`` and ``tool_choice``, stop sequences, sampling), and it runs through
``GenerationService.run`` like any other request. ``max_tokens`` is the client's cap, clamped to the
context the prompt leaves (Claude Code asks for 32000). The reply is Anthropic's ``message`` or its
typed stream events; errors are Anthropic's ``{"type": "error", "error": {...}}``, naming the field.
Unknown top-level fields and ``anthropic-beta`` headers are ignored, never refused (their names are
logged), as are ``thinking`` (any type: the server's reasoning parser decides what is thinking),
``metadata``, ``cache_control`` (prefix caching is automatic) and ``service_tier``.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api_stream import Output, collect, run_options
from gateway.errors import RequestError
from gateway.openai_protocol import BodyReader, status_of
from gateway.streamed_response import SSE, Encoder, Item, StreamedResponse
from gateway.token_only import refuse_text_call
from gateway.tool_request import Names
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

FIELDS = {
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p",
    "top_k", "tools", "tool_choice", "thinking", "metadata", "service_tier",
}  # fmt: skip
NAMES = Names(
    tools=lambda i, f: f"tools[{i}].input_schema" if f == "parameters" else f"tools[{i}].{f}",
    tool_list="tools",
    tool_choice="tool_choice",
    message=lambda i, f: f"messages[{i}].content",  # the chat message made from the client's blocks
)
STOP_REASON = {
    pb.FINISH_REASON_STOP: "end_turn",
    pb.FINISH_REASON_LENGTH: "max_tokens",
    pb.FINISH_REASON_TOOL_CALLS: "tool_use",
    pb.FINISH_REASON_ABORT: "end_turn",
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class AnthropicApi:
    def __init__(self, api) -> None:
        self.api = api  # the HttpApi: its state, generation service, auth and body reading

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def messages(self, request: Request) -> Response:
        return await self.api._guarded(request, self._messages, error_response)

    async def count_tokens(self, request: Request) -> Response:
        return await self.api._guarded(request, self._count_tokens, error_response)

    async def _messages(self, request: Request, identity, body) -> Response:
        s = self.api.s
        if s.token_only:
            refuse_text_call("messages", "messages (the chat template)")
        req, max_tokens = messages_request(body, s.limits)
        s.check_serving()
        s.check_model(req.model)
        meta = {"id": "msg_" + uuid.uuid4().hex[:24], "model": body.get("model") or s.model_name}
        prompt: list[int] = []
        options = run_options(NAMES, max_tokens, lambda ids: prompt.append(len(ids)))
        if body.get("stream"):
            return StreamedResponse(self.api.service, identity, [(req, options)], _Events(meta, prompt), SSE)
        out = await collect(self.api, request, identity, req, options)
        if out is None:
            return Response(status_code=499)
        return JSONResponse(message(meta, out))

    async def _count_tokens(self, request: Request, identity, body) -> Response:
        s = self.api.s
        if s.token_only:
            refuse_text_call("messages", "counting tokens (the chat template)")
        req, _ = messages_request(body, s.limits, counting=True)
        tok = pb.TokenizeRequest(model=req.model)
        tok.chat.CopyFrom(req.chat)
        out = await self.api.service.tokenize(tok)
        return JSONResponse({"input_tokens": out.count})


def error_response(e: RequestError, status: int | None = None) -> JSONResponse:
    status = status or status_of(e.code)
    message = e.message
    if e.violations:  # each field named (the chat request's prompt is this API's messages)
        message = "; ".join(
            f"{'messages' if v.field == 'chat' else v.field}: {v.description}" for v in e.violations
        )
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(e.retry_after_s)))
    body = {"type": "error", "error": {"type": ERROR_TYPE.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


# --- the request ------------------------------------------------------------------------------------


def messages_request(body, limits, counting: bool = False) -> tuple[pb.GenerateRequest, int | None]:
    """The chat GenerateRequest of a Messages body, and its ``max_tokens`` (the cap to clamp to)."""
    r = BodyReader(body, FIELDS, "messages")
    req = pb.GenerateRequest()
    req.model = r.str("model") or ""
    max_tokens = r.int("max_tokens", 1)
    if max_tokens is None and not counting and "max_tokens" not in r.body:
        r.bad("max_tokens", "is required: the most tokens to generate (clamped to the context left)")
    for name in ("temperature", "top_p"):
        value = r.num(name)
        if value is not None:
            setattr(req, name, value)
    top_k = r.int("top_k", 0)
    if top_k:
        req.top_k = min(top_k, 2**31 - 1)
    stops = r.str_list("stop_sequences")
    if stops:
        req.stop.extend(stops)
    thinking = r.get("thinking", lambda x: isinstance(x, dict), "an object {type: enabled|disabled|adaptive}")
    if thinking is not None and thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        r.bad("thinking.type", 'must be "enabled", "disabled" or "adaptive"')
    r.get("metadata", lambda x: isinstance(x, dict), "an object")
    r.bool("stream")
    chat = req.chat
    system = body.get("system")
    if system is not None:
        text = _text_of(system)
        if text is None:
            r.bad("system", "must be a string or a list of text blocks")
        elif text:
            chat.messages.add(role="system", content=text)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        r.bad("messages", "is required: a non-empty list of {role, content}")
    elif len(messages) > limits.max_chat_messages:
        r.bad(
            "messages",
            f"has {len(messages)} messages; the limit is max_chat_messages={limits.max_chat_messages}",
        )
    else:
        for i, m in enumerate(messages):
            if not _read_message(r, i, m, chat):
                break
    _read_tools(r, chat)
    r.done()
    return req, max_tokens


def _text_of(content) -> str | None:
    """A string, or the text of a list of text blocks (their ``cache_control`` ignored)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return (
            "\n\n".join(b["text"] for b in content)
            if len(content) > 1
            else "".join(b["text"] for b in content)
        )
    return None


def _read_message(r: BodyReader, i: int, m, chat: pb.Chat) -> bool:
    """One Messages message as chat messages: tool results become ``tool`` messages (before the
    user's text in the same turn), an assistant's ``tool_use`` blocks its tool calls, ``thinking``
    blocks of earlier turns are dropped (the template does not show them)."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant", "system"):
        r.bad(f"messages[{i}].role", 'must be "user", "assistant" or "system"')
        return False
    content = m.get("content")
    if isinstance(content, str):
        chat.messages.add(role=role, content=content)
        return True
    if not isinstance(content, list):
        r.bad(f"messages[{i}].content", "must be a string or a list of content blocks")
        return False
    texts: list[str] = []
    calls: list[tuple[str, str, str]] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            name, call_id, args = b.get("name"), b.get("id"), b.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, dict):
                r.bad(where, "a tool_use block must be {id: string, name: string, input: object}")
                return False
            calls.append((call_id, name, json.dumps(args, ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            call_id = b.get("tool_use_id")
            result = b.get("content", "")
            text = _result_text(result)
            if not isinstance(call_id, str) or text is None:
                r.bad(
                    where, "a tool_result block must be {tool_use_id: string, content: string or text blocks}"
                )
                return False
            if b.get("is_error") is True:
                text = "Error: " + text
            chat.messages.add(role="tool", content=text, tool_call_id=call_id)
        elif kind in ("tool_use", "tool_result"):
            r.bad(
                f"{where}.type",
                f"a {kind} block belongs in a{'n assistant' if kind == 'tool_use' else ' user'} message",
            )
            return False
        else:
            r.bad(
                f"{where}.type", f"{kind!r} blocks are not supported (text, tool_use, tool_result, thinking)"
            )
            return False
    if texts or calls or not content:
        out = chat.messages.add(role=role)
        if texts or not calls:
            out.content = "\n\n".join(texts) if len(texts) > 1 else "".join(texts)
        for call_id, name, args in calls:
            out.tool_calls.add(id=call_id, name=name, arguments=args)
    return True


def _result_text(result) -> str | None:
    if isinstance(result, str):
        return result
    if isinstance(result, list):
        parts = []
        for b in result:
            if not isinstance(b, dict):
                return None
            if b.get("type") == "text" and isinstance(b.get("text"), str):
                parts.append(b["text"])
            elif b.get("type") == "image":
                parts.append("[image]")  # the model reads text only
            else:
                return None
        return "\n".join(parts)
    return None


def _read_tools(r: BodyReader, chat: pb.Chat) -> None:
    tools = r.get("tools", lambda x: isinstance(x, list), "a list of {name, description, input_schema}")
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict):
            r.bad(f"tools[{i}]", "must be {name, description, input_schema}")
            return
        if t.get("type") not in (None, "custom"):
            r.bad(
                f"tools[{i}].type",
                f"{str(t.get('type'))[:64]!r} (a server tool) is not supported: only custom tools",
            )
            return
        name, description, schema = t.get("name"), t.get("description"), t.get("input_schema")
        if not isinstance(name, str):
            r.bad(f"tools[{i}].name", "must be a string")
            return
        if description is not None and not isinstance(description, str):
            r.bad(f"tools[{i}].description", "must be a string")
            return
        if not isinstance(schema, dict):
            r.bad(f"tools[{i}].input_schema", "is required: a JSON Schema object")
            return
        chat.tools.add(name=name, description=description or "", parameters=json.dumps(schema))
    choice = r.get("tool_choice", lambda x: isinstance(x, dict), "an object {type: auto|any|tool|none}")
    if choice is None:
        return
    kind = choice.get("type")
    if kind == "auto":
        chat.tool_choice.mode = pb.ToolChoice.MODE_AUTO
    elif kind == "any":
        chat.tool_choice.mode = pb.ToolChoice.MODE_REQUIRED
    elif kind == "none":
        chat.tool_choice.mode = pb.ToolChoice.MODE_NONE
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat.tool_choice.function = choice["name"]
    else:
        r.bad(
            "tool_choice",
            'must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name"}',
        )
        return
    if choice.get("disable_parallel_tool_use") is True:
        chat.parallel_tool_calls = False


# --- the reply --------------------------------------------------------------------------------------


def _stop(out: Output) -> tuple[str, str | None]:
    if out.stop_string is not None and out.finish == pb.FINISH_REASON_STOP:
        return "stop_sequence", out.stop_string
    return STOP_REASON.get(out.finish, "end_turn"), None


def _usage(out: Output) -> dict:
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens,
        "cache_read_input_tokens": out.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": out.completion_tokens,
    }


def _block(b) -> dict:
    if b.kind == "thinking":
        return {"type": "thinking", "thinking": b.text, "signature": ""}
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": json.loads(b.text or "{}")}


def message(meta: dict, out: Output) -> dict:
    reason, sequence = _stop(out)
    return {
        **meta,
        "type": "message",
        "role": "assistant",
        "content": [_block(b) for b in out.blocks],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(out),
    }


class _Events(Encoder):
    """Anthropic's stream: message_start, ping, per block content_block_start / _delta / _stop,
    message_delta (stop reason, usage), message_stop."""

    def __init__(self, meta: dict, prompt: list[int]) -> None:
        self.meta, self.prompt, self.out = meta, prompt, Output()
        self.started = time.monotonic()

    def start(self) -> list[Item]:
        n = self.prompt[0] if self.prompt else 0
        start = {
            **self.meta,
            "type": "message",
            "role": "assistant",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": n, "output_tokens": 0},
        }
        return [
            ("message_start", {"type": "message_start", "message": start}),
            ("ping", {"type": "ping"}),
        ]

    def message(self, p: int, msg: pb.GenerateResponse) -> list[Item]:
        chunks = []
        for ev in self.out.feed(msg):
            b = self.out.blocks[ev[1]]
            if ev[0] == "open":
                if b.kind == "thinking":
                    first = {"type": "thinking", "thinking": "", "signature": ""}
                elif b.kind == "text":
                    first = {"type": "text", "text": ""}
                else:
                    first = {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {}}
                data = {"type": "content_block_start", "index": ev[1], "content_block": first}
                chunks.append(("content_block_start", data))
            elif ev[0] == "delta":
                if b.kind == "thinking":
                    delta = {"type": "thinking_delta", "thinking": ev[2]}
                elif b.kind == "text":
                    delta = {"type": "text_delta", "text": ev[2]}
                else:
                    delta = {"type": "input_json_delta", "partial_json": ev[2]}
                data = {"type": "content_block_delta", "index": ev[1], "delta": delta}
                chunks.append(("content_block_delta", data))
            else:
                if b.kind == "thinking":  # the SDKs expect a signature; there is none to give
                    data = {
                        "type": "content_block_delta",
                        "index": ev[1],
                        "delta": {"type": "signature_delta", "signature": ""},
                    }
                    chunks.append(("content_block_delta", data))
                chunks.append(("content_block_stop", {"type": "content_block_stop", "index": ev[1]}))
        return chunks

    def end(self) -> list[Item]:
        reason, sequence = _stop(self.out)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": _usage(self.out),
        }
        return [("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def error(self, e: RequestError) -> list[Item]:
        return [("error", json.loads(error_response(e).body))]

    def refusal(self, e: RequestError) -> Response:
        return error_response(e)
