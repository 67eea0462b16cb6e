"""OpenAI's JSON bodies to ``llmserve.v1.GenerateRequest`` and the stream's messages back.

Nothing here generates: a body becomes the same proto a gRPC client would send, and it runs through
the one generation path (``GenerationService.run``). Only what the proto cannot carry is refused
here (a string where a number belongs, a negative count for a uint32 field, an id past int32, a
field we do not support): a 400 naming the field. Ranges and limits are not checked here: the
gRPC path's validation (``SamplingParams.violations``, engine_svc/request_limits.py) checks them,
so both APIs refuse the same requests with the same words. Unknown fields are ignored, as vLLM's
OpenAI server does by default (their names, never their values, are logged).
"""

from __future__ import annotations

import json
import logging

import grpc

from gateway.errors import FieldViolation, RequestError, invalid
from gateway.limits import Limits
from gateway.quoting import quote
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

log = logging.getLogger("gateway.http")

FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}

_COMMON = {
    "model", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "stream", "stream_options", "response_format",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "return_token_ids",
    "allowed_token_ids", "bad_words", "request_id", "priority", "best_of", "speculative",
}  # fmt: skip
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools"}
# Editor autocomplete: stop_at ("line" / "block"), stop_indent, supersede_key (GenerateRequest's).
CODE_FIELDS = {"stop_at", "stop_indent", "supersede_key", "fim_order"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix"} | CODE_FIELDS
CHAT_FIELDS = _COMMON | {
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
    "tools", "tool_choice", "parallel_tool_calls",
}  # fmt: skip


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


class BodyTooLarge(Exception):
    """An HTTP request body over ``max_message_bytes``: refused with 413 before it is read whole."""

    def __init__(self, cap: int) -> None:
        self.cap = cap


class BodyReader:
    """Typed access to a JSON object's fields; every type error is collected, then raised at once."""

    def __init__(self, body, allowed: set[str], what: str) -> None:
        if not isinstance(body, dict):
            raise invalid([FieldViolation("body", "must be a JSON object")])
        self.body = body
        self.v: list[FieldViolation] = []
        unknown = [k for k in body if k not in allowed]
        if unknown:  # names only, each quoted short (a name is the client's text too)
            names = [quote(k, 32) for k in unknown[:16]]
            log.info("ignored unknown fields of a %s request", what, extra={"fields": {"ignored": names}})

    def bad(self, field: str, why: str) -> None:
        self.v.append(FieldViolation(field, why))

    def get(self, name: str, check, rule: str):
        value = self.body.get(name)
        if value is None:
            return None
        if not check(value):
            self.bad(name, f"must be {rule}")
            return None
        return value

    def int(self, name: str, minimum: int | None = 0):
        """An integer; ``minimum`` 0 for the proto's unsigned fields, which cannot hold less."""
        value = self.get(name, _is_int, "an integer")
        if value is not None and minimum is not None and value < minimum:
            self.bad(name, f"must be >= {minimum}, got {value}")
            return None
        if value is not None and not -(2**63) <= value < 2**63:
            self.bad(name, "is out of range")
            return None
        return value

    def num(self, name: str):
        return self.get(name, _is_num, "a number")

    def bool(self, name: str):
        return self.get(name, lambda x: isinstance(x, bool), "true or false")

    def str(self, name: str):
        return self.get(name, lambda x: isinstance(x, str), "a string")

    def int_list(self, name: str):
        return self.get(
            name, lambda x: isinstance(x, list) and all(_is_int(t) for t in x), "a list of integers"
        )

    def str_list(self, name: str):
        return self.get(
            name, lambda x: isinstance(x, list) and all(isinstance(t, str) for t in x), "a list of strings"
        )

    def done(self) -> None:
        if self.v:
            raise invalid(self.v)


def _uint32(r: BodyReader, name: str, value: int | None) -> int | None:
    if value is not None and value >= 2**32:
        r.bad(name, f"must be < 2**32, got {value}")
        return None
    return value


def common_request(r: BodyReader, req: pb.GenerateRequest, limits: Limits) -> None:
    """The fields completions and chat share, onto ``req``."""
    req.model = r.str("model") or ""
    req.request_id = r.str("request_id") or ""
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        value = r.num(name)
        if value is not None:
            setattr(req, name, value)
    for name in ("n", "min_tokens", "prompt_logprobs"):
        value = _uint32(r, name, r.int(name))
        if value is not None:
            setattr(req, name, value)
    best_of = r.int("best_of", 1)  # the proto has no best_of: only the value that means n can go
    if best_of is not None and best_of != (req.n if req.HasField("n") else 1):
        r.bad("best_of", "is not supported (only best_of == n)")
    top_k = r.int("top_k", None)
    if top_k is not None:
        if not -(2**31) <= top_k < 2**31:
            r.bad("top_k", "is out of range")
        else:
            req.top_k = top_k
    seed = r.int("seed", None)
    if seed is not None:
        req.seed = seed
    priority = r.int("priority", None)
    if priority is not None:
        if not -(2**31) <= priority < 2**31:
            r.bad("priority", "is out of range")
        else:
            req.priority = priority
    stop = r.body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop.extend(stop)  # their count and lengths: the shared validation's
    elif stop is not None:
        r.bad("stop", "must be a string or a list of strings")
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = r.int_list(name)
        if ids is not None:
            if any(not -(2**31) <= t < 2**31 for t in ids):
                r.bad(name, "holds an id out of range")
            else:
                getattr(req, name).extend(ids)
    words = r.str_list("bad_words")
    if words:
        req.bad_words.extend(words)
    for name in ("ignore_eos", "include_stop_str_in_output", "return_token_ids"):
        if r.bool(name):
            setattr(req, name, True)
    skip = r.bool("skip_special_tokens")
    if skip is not None:
        req.skip_special_tokens = skip
    speculative = r.bool("speculative")  # false: this request never drafts
    if speculative is not None:
        req.speculative = speculative
    bias = r.get("logit_bias", lambda x: isinstance(x, dict), "an object of token id -> bias")
    if bias:
        for key, value in bias.items():
            try:
                tid = int(key)
            except ValueError:
                r.bad(f"logit_bias[{key[:32]!r}]", "keys must be token ids")
                break
            if not _is_num(value) or not -(2**31) <= tid < 2**31:
                r.bad(f"logit_bias[{tid}]", "must be a number, for a token id in range")
                break
            req.logit_bias[tid] = value
    r.get("user", lambda x: isinstance(x, str), "a string")  # accepted; not used
    fmt = r.get("response_format", lambda x: isinstance(x, dict), "an object")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            req.json_object = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict | bool):
                r.bad("response_format.json_schema.schema", "must be a JSON Schema object")
            else:
                req.json_schema = json.dumps(schema)
        elif kind != "text":
            r.bad("response_format.type", "must be one of text, json_object, json_schema")
    options = r.get("stream_options", lambda x: isinstance(x, dict), "an object")
    if options is not None and not isinstance(options.get("include_usage", False), bool):
        r.bad("stream_options.include_usage", "must be true or false")


_STOP_AT = {"line": pb.STOP_AT_LINE, "block": pb.STOP_AT_BLOCK}


def code_options(r: BodyReader, req: pb.GenerateRequest) -> None:
    """An editor's completion options: where the output ends (``stop_at`` "line" or "block", with
    ``stop_indent`` for the block's indentation) and ``supersede_key`` (a new request with the key
    cancels the one in flight with it). Their limits are checked with the request's."""
    stop_at = r.get("stop_at", lambda x: x in _STOP_AT, '"line" or "block"')
    if stop_at is not None:
        req.stop_at = _STOP_AT[stop_at]
    indent = r.int("stop_indent")
    if indent is not None:
        req.stop_indent = min(indent, 2**32 - 1)
    key = r.str("supersede_key")
    if key:
        req.supersede_key = key


_FIM_ORDER = {"psm": pb.FIM_ORDER_PSM, "spm": pb.FIM_ORDER_SPM}


def fim_order(r: BodyReader) -> int | None:
    """``fim_order`` ("psm" or "spm"): how a fill-in-the-middle prompt is laid out (unset: the
    server's ``--fim-order``)."""
    order = r.get("fim_order", lambda x: x in _FIM_ORDER, '"psm" or "spm"')
    return None if order is None else _FIM_ORDER[order]


def completion_requests(body, limits: Limits) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt (``prompt`` may be a list of prompts)."""
    r = BodyReader(body, COMPLETION_FIELDS, "completions")
    base = pb.GenerateRequest()
    common_request(r, base, limits)
    max_tokens = _uint32(r, "max_tokens", r.int("max_tokens"))
    if max_tokens is not None:
        base.max_tokens = max_tokens
    logprobs = _uint32(r, "logprobs", r.int("logprobs"))
    if logprobs is not None:
        base.logprobs = logprobs
    if r.bool("echo"):
        r.bad("echo", "is not supported")
    code_options(r, base)
    suffix = r.str("suffix")  # with it, each prompt is the code before the cursor (fill-in-the-middle)
    prompt = body.get("prompt")
    prompts: list = []
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > limits.max_n:
            r.bad("prompt", f"at most {limits.max_n} prompts in one request (max_n), got {len(prompt)}")
        elif all(isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p)) for p in prompt):
            prompts = prompt
        else:
            r.bad("prompt", "must be a string, a list of token ids, or a list of either")
    else:
        r.bad("prompt", "is required: a string, a list of token ids, or a list of either")
    if suffix is not None and any(not isinstance(p, str) for p in prompts):
        r.bad("suffix", "needs a text prompt (the code before the cursor), not token ids")
    order = fim_order(r)
    if order is not None and suffix is None:
        r.bad("fim_order", "goes with suffix (it lays out a fill-in-the-middle prompt)")
    r.done()
    out = []
    for i, p in enumerate(prompts):
        req = pb.GenerateRequest()
        req.CopyFrom(base)
        if req.request_id and len(prompts) > 1:
            req.request_id = f"{base.request_id}-{i}"
        if suffix is not None:
            req.infill.prefix, req.infill.suffix = p, suffix
            if order is not None:
                req.infill.order = order
        elif isinstance(p, str):
            req.text = p
        else:
            if any(not -(2**31) <= t < 2**31 for t in p):  # the vocabulary is checked by validation
                raise invalid([FieldViolation("prompt", "holds a token id out of the int32 range")])
            req.token_ids.ids.extend(p)
        out.append(req)
    return out


def chat_request(body, limits: Limits) -> pb.GenerateRequest:
    r = BodyReader(body, CHAT_FIELDS, "chat completions")
    req = pb.GenerateRequest()
    common_request(r, req, limits)
    max_tokens = r.int("max_completion_tokens")
    if max_tokens is None:
        max_tokens = r.int("max_tokens")
    max_tokens = _uint32(r, "max_tokens", max_tokens)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if r.bool("logprobs"):
        top = _uint32(r, "top_logprobs", r.int("top_logprobs"))
        req.logprobs = top or 0
    elif body.get("top_logprobs") is not None:
        r.bad("top_logprobs", "needs logprobs: true")
    read_tools(r, req.chat)
    add = r.bool("add_generation_prompt")
    if add is not None:
        req.chat.add_generation_prompt = add
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        r.bad("messages", "is required: a non-empty list of {role, content}")
    elif len(messages) > limits.max_chat_messages:  # counted before any is looked at
        r.bad(
            "messages",
            f"has {len(messages)} messages; the limit is max_chat_messages={limits.max_chat_messages}",
        )
    else:
        for i, m in enumerate(messages):
            if not read_message(r, i, m, req.chat.messages.add()):
                break
    r.done()
    return req


def read_message(r: BodyReader, i: int, m, out: pb.ChatMessage) -> bool:
    """One chat message onto ``out``; False (with the violation) if it is not one."""
    role = m.get("role") if isinstance(m, dict) else None
    calls = m.get("tool_calls") if isinstance(m, dict) else None
    raw = m.get("content") if isinstance(m, dict) else None
    content = _content(raw)
    if not isinstance(role, str) or (content is None and not (raw is None and calls)):
        r.bad(f"messages[{i}]", "must be {role: string, content: string or a list of text parts}")
        return False
    out.role = role
    if content is not None:
        out.content = content
    if calls is not None:
        if not isinstance(calls, list):
            r.bad(f"messages[{i}].tool_calls", "must be a list of calls")
            return False
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, str):
                r.bad(
                    f"messages[{i}].tool_calls[{j}]",
                    "must be {id, type: function, function: {name: string, arguments: JSON text}}",
                )
                return False
            try:
                parsed = json.loads(args) if args else {}
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                r.bad(f"messages[{i}].tool_calls[{j}].function.arguments", "must be a JSON object as text")
                return False
            call_id = call.get("id")
            out.tool_calls.add(
                id=call_id if isinstance(call_id, str) else "", name=fn["name"], arguments=args
            )
    for name in ("tool_call_id", "name"):
        value = m.get(name)
        if value is not None and not isinstance(value, str):
            r.bad(f"messages[{i}].{name}", "must be a string")
            return False
        if value:
            setattr(out, name, value)
    return True


def read_tools(r: BodyReader, chat: pb.Chat) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` (their meaning is checked with the
    server's settings in ``gateway.tool_request``, for both APIs)."""
    tools = r.get("tools", lambda x: isinstance(x, list), "a list of {type: function, function: {...}}")
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            r.bad(f"tools[{i}]", 'must be {"type": "function", "function": {name, description, parameters}}')
            return
        name, description, params = fn.get("name"), fn.get("description"), fn.get("parameters")
        if not isinstance(name, str):
            r.bad(f"tools[{i}].function.name", "must be a string")
            return
        if description is not None and not isinstance(description, str):
            r.bad(f"tools[{i}].function.description", "must be a string")
            return
        if params is not None and not isinstance(params, dict):
            r.bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
            return
        chat.tools.add(
            name=name, description=description or "", parameters=json.dumps(params) if params else ""
        )
    choice = r.body.get("tool_choice")
    if isinstance(choice, str):
        modes = {
            "auto": pb.ToolChoice.MODE_AUTO,
            "none": pb.ToolChoice.MODE_NONE,
            "required": pb.ToolChoice.MODE_REQUIRED,
        }
        if choice not in modes:
            r.bad(
                "tool_choice",
                'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
            )
        else:
            chat.tool_choice.mode = modes[choice]
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            r.bad(
                "tool_choice",
                'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
            )
        else:
            chat.tool_choice.function = fn["name"]
    elif choice is not None:
        r.bad(
            "tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}'
        )
    parallel = r.bool("parallel_tool_calls")
    if parallel is not None:
        chat.parallel_tool_calls = parallel


def _content(content) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]; only text parts
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                return None
            parts.append(part["text"])
        return "".join(parts)
    return None


def status_of(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.CANCELLED: 499,  # superseded by the client's next request (supersede_key)
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_body(e: RequestError, status: int | None = None) -> dict:
    status = status or status_of(e.code)
    return {
        "error": {
            "message": e.message,
            "type": ERROR_TYPE.get(status, "internal_error"),
            "param": e.violations[0].field if e.violations else None,
            "code": e.code.name.lower(),
        }
    }
