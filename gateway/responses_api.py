"""OpenAI's Responses API (``POST /v1/responses``), stateless: what Codex and the ``openai-agents``
SDK speak, as a translation onto the one generation path.

``instructions`` and ``input`` (a string, or items: messages with input_text / output_text parts,
``function_call`` and ``function_call_output`` items, reasoning items, which are dropped) become the
chat ``GenerateRequest`` the chat completions route would make; function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens`` (clamped to the context left), ``temperature``,
``top_p`` and ``text.format`` map onto its fields. Nothing is stored: ``store`` is answered false,
and ``previous_response_id`` (a conversation kept by the server) is refused, naming the field. The
reply is a ``response`` object, or the ``response.*`` events; errors are OpenAI's shape.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api_stream import Output, collect, run_options
from gateway.errors import FieldViolation, RequestError
from gateway.openai_protocol import BodyReader, error_body, status_of
from gateway.streamed_response import SSE, Encoder, Item, StreamedResponse
from gateway.token_only import refuse_text_call
from gateway.tool_request import Names
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "stream", "store", "previous_response_id", "text", "reasoning", "metadata",
    "user", "include", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
    "stream_options", "top_logprobs", "background", "max_tool_calls",
}  # fmt: skip
NAMES = Names(
    tools=lambda i, f: f"tools[{i}].{f}",
    tool_list="tools",
    tool_choice="tool_choice",
    message=lambda i, f: f"input[{i}]",
)


class ResponsesApi:
    def __init__(self, api) -> None:
        self.api = api

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.responses, methods=["POST"])]

    async def responses(self, request: Request) -> Response:
        return await self.api._guarded(request, self._responses)

    async def _responses(self, request: Request, identity, body) -> Response:
        try:
            return await self._respond(request, identity, body)
        except RequestError as e:
            raise _as_input(e) from None

    async def _respond(self, request: Request, identity, body) -> Response:
        s = self.api.s
        if s.token_only:
            refuse_text_call("input", "responses (the chat template)")
        req, max_tokens = responses_request(body, s.limits)
        s.check_serving()
        s.check_model(req.model)
        meta = _meta(body, s.model_name, max_tokens)
        options = run_options(NAMES, max_tokens)
        if body.get("stream"):
            return StreamedResponse(self.api.service, identity, [(req, options)], _Events(meta), SSE)
        out = await collect(self.api, request, identity, req, options)
        if out is None:
            return Response(status_code=499)
        return JSONResponse(response(meta, out, _Ids()))


# --- the request ------------------------------------------------------------------------------------


def responses_request(body, limits) -> tuple[pb.GenerateRequest, int | None]:
    r = BodyReader(body, FIELDS, "responses")
    req = pb.GenerateRequest()
    req.model = r.str("model") or ""
    max_tokens = r.int("max_output_tokens", 1)
    for name in ("temperature", "top_p"):
        value = r.num(name)
        if value is not None:
            setattr(req, name, value)
    if body.get("previous_response_id") is not None:
        r.bad(
            "previous_response_id",
            "is not supported: this server keeps no responses (send the whole conversation as input)",
        )
    r.bool("store")  # nothing is stored either way; the reply says store: false
    r.bool("stream")
    text = r.get("text", lambda x: isinstance(x, dict), "an object {format: {...}}")
    fmt = (text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            r.bad("text.format.schema", "must be a JSON Schema object")
        else:
            req.json_schema = json.dumps(fmt["schema"])
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        req.json_object = True
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        r.bad("text.format.type", "must be one of text, json_object, json_schema")
    chat = req.chat
    instructions = r.str("instructions")
    if instructions:
        chat.messages.add(role="system", content=instructions)
    items = body.get("input")
    if isinstance(items, str):
        chat.messages.add(role="user", content=items)
    elif isinstance(items, list) and items:
        if len(items) > limits.max_chat_messages:
            r.bad(
                "input", f"has {len(items)} items; the limit is max_chat_messages={limits.max_chat_messages}"
            )
        else:
            _read_items(r, items, chat)
    else:
        r.bad("input", "is required: a string or a non-empty list of input items")
    _read_tools(r, chat)
    r.done()
    return req, max_tokens


def _part_text(content) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in (
                "input_text",
                "output_text",
                "text",
                "refusal",
            ):
                return None
            t = p.get("text", p.get("refusal"))
            if not isinstance(t, str):
                return None
            parts.append(t)
        return "".join(parts)
    return None


def _read_items(r: BodyReader, items: list, chat: pb.Chat) -> None:
    """Input items as chat messages; consecutive function calls are one assistant turn's calls."""
    calls_to = None  # the assistant message the next function_call joins
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            role = "system" if role == "developer" else role
            text = _part_text(item.get("content"))
            if role not in ("user", "assistant", "system") or text is None:
                r.bad(
                    f"input[{i}]",
                    "a message must be {role: user|assistant|system|developer, content: text or parts}",
                )
                return
            chat.messages.add(role=role, content=text)
            calls_to = chat.messages[-1] if role == "assistant" else None
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not (isinstance(name, str) and isinstance(call_id, str) and isinstance(args, str)):
                r.bad(f"input[{i}]", "a function_call must be {call_id, name, arguments: JSON text}")
                return
            try:
                ok = isinstance(json.loads(args or "{}"), dict)
            except ValueError:
                ok = False
            if not ok:
                r.bad(f"input[{i}].arguments", "must be a JSON object as text")
                return
            if calls_to is None:
                calls_to = chat.messages.add(role="assistant")
            calls_to.tool_calls.add(id=call_id, name=name, arguments=args or "{}")
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            text = _part_text(output) if not isinstance(output, str) else output
            if not isinstance(call_id, str) or text is None:
                r.bad(f"input[{i}]", "a function_call_output must be {call_id, output: string}")
                return
            chat.messages.add(role="tool", content=text, tool_call_id=call_id)
            calls_to = None
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: the template does not show it
        else:
            r.bad(f"input[{i}].type", f"{str(kind)[:64]!r} items are not supported")
            return


def _read_tools(r: BodyReader, chat: pb.Chat) -> None:
    tools = r.get("tools", lambda x: isinstance(x, list), "a list of {type: function, name, parameters}")
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            r.bad(f"tools[{i}].type", f"{str(kind)[:64]!r} tools are not supported: only function tools")
            return
        name, description, params = t.get("name"), t.get("description"), t.get("parameters")
        if not isinstance(name, str):
            r.bad(f"tools[{i}].name", "must be a string")
            return
        if description is not None and not isinstance(description, str):
            r.bad(f"tools[{i}].description", "must be a string")
            return
        if params is not None and not isinstance(params, dict):
            r.bad(f"tools[{i}].parameters", "must be a JSON Schema object")
            return
        chat.tools.add(
            name=name, description=description or "", parameters=json.dumps(params) if params else ""
        )
    choice = body_choice = r.body.get("tool_choice")
    modes = {
        "auto": pb.ToolChoice.MODE_AUTO,
        "none": pb.ToolChoice.MODE_NONE,
        "required": pb.ToolChoice.MODE_REQUIRED,
    }
    if isinstance(choice, str) and choice in modes:
        chat.tool_choice.mode = modes[choice]
    elif (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
    ):
        chat.tool_choice.function = choice["name"]
    elif body_choice is not None:
        r.bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name"}')
    parallel = r.bool("parallel_tool_calls")
    if parallel is not None:
        chat.parallel_tool_calls = parallel


# --- the reply --------------------------------------------------------------------------------------


def _meta(body: dict, model: str, max_tokens: int | None) -> dict:
    def echo(name, default=None):
        value = body.get(name) if isinstance(body, dict) else None
        return default if value is None else value

    return {
        "id": "resp_" + uuid.uuid4().hex,
        "object": "response",
        "created_at": int(time.time()),
        "model": echo("model", model),
        "instructions": echo("instructions"),
        "max_output_tokens": max_tokens,
        "parallel_tool_calls": echo("parallel_tool_calls", True),
        "previous_response_id": None,
        "store": False,
        "temperature": echo("temperature", 1.0),
        "top_p": echo("top_p", 1.0),
        "tool_choice": echo("tool_choice", "auto"),
        "tools": echo("tools", []),
        "text": echo("text", {"format": {"type": "text"}}),
        "truncation": "disabled",
        "metadata": echo("metadata", {}),
        "reasoning": echo("reasoning", None),
        "error": None,
        "incomplete_details": None,
        "user": echo("user"),
    }


class _Ids:
    """Item ids, stable between a stream's events and its final response."""

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}

    def of(self, i: int, kind: str) -> str:
        prefix = {"thinking": "rs_", "text": "msg_", "call": "fc_"}[kind]
        return self.ids.setdefault(i, prefix + uuid.uuid4().hex[:24])


def _item(b, item_id: str, status: str = "completed") -> dict:
    if b.kind == "thinking":
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": b.text}],
            "status": status,
        }
    if b.kind == "text":
        content = [{"type": "output_text", "text": b.text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": b.call_id,
        "name": b.name,
        "arguments": b.text,
        "status": status,
    }


def _usage(out: Output) -> dict:
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.cached_tokens},
        "output_tokens": out.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def response(meta: dict, out: Output, ids: _Ids) -> dict:
    incomplete = out.finish == pb.FINISH_REASON_LENGTH
    return {
        **meta,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": [_item(b, ids.of(i, b.kind)) for i, b in enumerate(out.blocks)],
        "usage": _usage(out),
    }


class _Events(Encoder):
    """``response.created`` / ``in_progress``, per item ``output_item.added``, its deltas and
    ``.done`` events, ``output_item.done``; ``response.completed`` (or ``.incomplete``) last."""

    def __init__(self, meta: dict) -> None:
        self.meta, self.out, self.ids, self.seq = meta, Output(), _Ids(), 0

    def _ev(self, kind: str, **data) -> Item:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return kind, payload

    def start(self) -> list[Item]:
        head = {**self.meta, "status": "in_progress", "output": [], "usage": None}
        return [self._ev("response.created", response=head), self._ev("response.in_progress", response=head)]

    def message(self, p: int, msg: pb.GenerateResponse) -> list[Item]:
        chunks = []
        for ev in self.out.feed(msg):
            i = ev[1]
            b = self.out.blocks[i]
            item_id = self.ids.of(i, b.kind)
            if ev[0] == "open":
                item = _item(b, item_id, "in_progress")
                if b.kind == "text":
                    item["content"] = []
                elif b.kind == "call":
                    item["arguments"] = ""
                else:
                    item["content"] = []
                chunks.append(self._ev("response.output_item.added", output_index=i, item=item))
                if b.kind == "text":
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    chunks.append(
                        self._ev(
                            "response.content_part.added",
                            item_id=item_id,
                            output_index=i,
                            content_index=0,
                            part=part,
                        )
                    )
            elif ev[0] == "delta":
                if b.kind == "text":
                    chunks.append(
                        self._ev(
                            "response.output_text.delta", item_id=item_id, output_index=i, content_index=0,
                            delta=ev[2], logprobs=[],
                        )
                    )  # fmt: skip
                elif b.kind == "call":
                    chunks.append(
                        self._ev(
                            "response.function_call_arguments.delta",
                            item_id=item_id,
                            output_index=i,
                            delta=ev[2],
                        )
                    )
                else:
                    chunks.append(
                        self._ev(
                            "response.reasoning_text.delta", item_id=item_id, output_index=i, content_index=0,
                            delta=ev[2],
                        )
                    )  # fmt: skip
            else:
                item = _item(b, item_id)
                if b.kind == "text":
                    chunks.append(
                        self._ev(
                            "response.output_text.done", item_id=item_id, output_index=i, content_index=0,
                            text=b.text, logprobs=[],
                        )
                    )  # fmt: skip
                    chunks.append(
                        self._ev(
                            "response.content_part.done", item_id=item_id, output_index=i, content_index=0,
                            part=item["content"][0],
                        )
                    )  # fmt: skip
                elif b.kind == "call":
                    chunks.append(
                        self._ev(
                            "response.function_call_arguments.done", item_id=item_id, output_index=i,
                            name=b.name, arguments=b.text,
                        )
                    )  # fmt: skip
                else:
                    chunks.append(
                        self._ev(
                            "response.reasoning_text.done", item_id=item_id, output_index=i, content_index=0,
                            text=b.text,
                        )
                    )  # fmt: skip
                chunks.append(self._ev("response.output_item.done", output_index=i, item=item))
        return chunks

    def end(self) -> list[Item]:
        whole = response(self.meta, self.out, self.ids)
        kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
        return [self._ev(kind, response=whole)]

    def error(self, e: RequestError) -> list[Item]:
        err = error_body(e)["error"]
        return [self._ev("error", code=err["code"], message=err["message"], param=err["param"])]

    def refusal(self, e: RequestError) -> Response:
        e = _as_input(e)
        status = status_of(e.code)
        return JSONResponse(error_body(e, status), status_code=status)


def _as_input(e: RequestError) -> RequestError:
    """The chat request's prompt (``chat``) is this API's ``input``."""
    if not any(v.field == "chat" for v in e.violations):
        return e
    named = [FieldViolation("input" if v.field == "chat" else v.field, v.description) for v in e.violations]
    message = e.message.replace("chat: ", "input: ")
    return RequestError(e.code, message, named, e.retry_after_s)
