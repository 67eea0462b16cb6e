"""The Ollama API (``/api/*``), for editors and agents that offer only an "Ollama" provider.

Each route is a translation: the Ollama body becomes the OpenAI body the chat and completion routes
read (``gateway.openai_protocol``), that becomes a ``GenerateRequest``, and it runs through
``GenerationService.run``, the one generation path (validation, admission, the tenant's cache salt,
metrics, backpressure, cancel on disconnect); embeddings go through ``EmbeddingService.embed``. The
output is Ollama's: newline-delimited JSON objects when streamed (the default), ``done`` and
``done_reason`` on the last, token counts and durations in nanoseconds. Errors are Ollama's shape,
``{"error": "..."}``, with the field named as the Ollama client spells it (``options.num_predict``).

Options: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``num_predict`` (-1 / -2: the rest of
the context), ``stop``, ``seed``, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``.
Unset, the sampling options take Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9).
Options about loading and the runtime (``num_ctx``, ``num_thread``, ``num_gpu``...) are ignored, as
is ``keep_alive``: the server's own flags decide those. ``mirostat``, ``tfs_z`` and ``typical_p``
are refused unless neutral. See docs/ollama.md.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from importlib import metadata

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import Identity
from gateway.embedding_service import EmbeddingService, vector
from gateway.embeddings_api import check_dimensions
from gateway.errors import FieldViolation, RequestError, invalid
from gateway.generation_service import merge_tool_calls
from gateway.openai_protocol import chat_request, completion_requests, status_of
from gateway.streamed_response import NDJSON, Encoder, Item, StreamedResponse, peer
from gateway.tool_request import HTTP_NAMES
from llmserve_proto.llmserve.v1 import embeddings_pb2 as epb
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

# Ollama option -> the OpenAI body's field (gateway.openai_protocol reads it).
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "num_predict": "max_tokens",
    "stop": "stop",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    # Editor autocomplete (ours; docs/fill-in-the-middle.md), on /api/generate.
    "stop_at": "stop_at",
    "stop_indent": "stop_indent",
    "supersede_key": "supersede_key",
    "fim_order": "fim_order",
}
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
NEUTRAL = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}  # refused unless they leave sampling as it is
DONE_REASON = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "stop",  # Ollama ends a turn of tool calls with "stop"
    pb.FINISH_REASON_ABORT: "abort",
}
# A violation's field as the generation path names it -> as an Ollama client spells it.
_RENAMES = {
    "max_tokens": "options.num_predict",
    "repetition_penalty": "options.repeat_penalty",
    "response_format": "format",
    "stop_at": "options.stop_at",
    "stop_indent": "options.stop_indent",
    "supersede_key": "options.supersede_key",
    "fim_order": "options.fim_order",
    "infill.order": "options.fim_order",
    "json_schema": "format",
    "json_object": "format",
    "constraint": "format",
    "text": "prompt",
    "chat.messages": "messages",
    "chat.tools": "tools",
    "chat.tool_choice": "tools",  # Ollama has no tool_choice: the tools themselves are refused
    "tool_choice": "tools",
    "chat": "messages",
    "infill.prefix": "prompt",
    "infill.suffix": "suffix",
    "infill": "suffix",
}
_OPTION_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
}


def ollama_field(field: str) -> str:
    for old, new in sorted(_RENAMES.items(), key=lambda kv: -len(kv[0])):
        if field == old or field.startswith((old + ".", old + "[")):
            return new + field[len(old) :]
    head = field.split("[", 1)[0].split(".", 1)[0]
    if head in _OPTION_FIELDS:
        return "options." + field
    return field


def ollama_error(e: RequestError, status: int | None = None) -> JSONResponse:
    """Ollama's error shape, each field as the Ollama client spells it."""
    if e.violations:
        message = "; ".join(f"{ollama_field(v.field)}: {v.description}" for v in e.violations)
    else:
        message = e.message
    status = status or status_of(e.code)
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s is not None else {}
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _bad(field: str, why: str) -> RequestError:
    return invalid([FieldViolation(field, why)])


# --- request translation --------------------------------------------------------------------------


def openai_options(body: dict) -> dict:
    """Ollama's ``options`` (and ``format``) as the OpenAI body's sampling fields."""
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise _bad("options", "must be an object")
    out = {OPTIONS[k]: v for k, v in OLLAMA_DEFAULTS.items()}
    for name, value in options.items():
        if name in NEUTRAL:
            if value is not None and value != NEUTRAL[name]:
                raise _bad(
                    f"options.{name}",
                    f"is not supported (only {NEUTRAL[name]}, which leaves sampling as it is)",
                )
            continue
        if name not in OPTIONS or value is None:
            continue  # loading and runtime options (num_ctx, num_thread, ...): the server's flags decide
        if name == "num_predict":
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                out.pop(
                    "max_tokens", None
                )  # -1 (no limit) and -2 (fill the context): the rest of the context
                continue
            if value == 0:
                raise _bad("options.num_predict", "must be > 0, or -1 for no limit")
        out[OPTIONS[name]] = value
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise _bad("format", 'must be "json" or a JSON Schema object')
    return out


def openai_messages(messages) -> list:
    """Ollama's chat messages as OpenAI's: tool calls carry their arguments as an object and no
    id; a tool result names its tool (``tool_name``)."""
    if not isinstance(messages, list):
        raise _bad("messages", "must be a list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be {role, content}")
        if m.get("images"):
            raise _bad(f"messages[{i}].images", "is not supported: the served model reads text only")
        msg = {"role": m.get("role"), "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls", "must be a list of {function: {name, arguments}}")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                args = fn.get("arguments", {}) if isinstance(fn, dict) else None
                if not isinstance(fn, dict) or not isinstance(args, dict | str):
                    raise _bad(
                        f"messages[{i}].tool_calls[{j}]", "must be {function: {name, arguments: object}}"
                    )
                text = args if isinstance(args, str) else json.dumps(args)
                call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{i}_{j}"
                msg["tool_calls"].append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": fn.get("name"), "arguments": text},
                    }
                )
        name = m.get("tool_name") or m.get("name")
        if name is not None:
            msg["name"] = name
        out.append(msg)
    return out


def _translated(read, body: dict):
    """``read(openai_body)`` with its violations renamed to Ollama's fields."""
    try:
        return read(body)
    except RequestError as e:
        if not e.violations:
            raise
        raise invalid([FieldViolation(ollama_field(v.field), v.description) for v in e.violations]) from None


def _think(think, model: str, can_think: bool) -> bool:
    """Ollama's ``think``: whether the reply shows the model's thinking. As Ollama: true on a model
    that does not think (here: no --reasoning-parser splits its thinking out) is refused with
    Ollama's words (a 400, ``"<model>" does not support thinking``), false is always accepted, and
    the levels ("high", "medium", "low") are gpt-oss's only."""
    if think is None:
        return True
    if isinstance(think, str):
        raise _bad("think", f"value {think[:32]!r} is not supported for this model (true or false)")
    if not isinstance(think, bool):
        raise _bad("think", "must be true or false")
    if think and not can_think:
        why = "does not support thinking (the server runs without --reasoning-parser)"
        raise _bad("think", f"{json.dumps(model)} {why}")
    return think


def switch_thinking(req: pb.GenerateRequest, think, has_switch: bool) -> None:
    """``think`` set, on a chat whose template has Qwen3's ``enable_thinking`` switch: passed to the
    template (Ollama passes its ``think`` to the template the same way), so that false renders the
    turn without thinking rather than only hiding it. A raw prompt has no template to switch."""
    if isinstance(think, bool) and has_switch and req.WhichOneof("prompt") == "chat":
        req.chat.enable_thinking = think


def _refuse_unsupported(body: dict, fields: tuple[str, ...]) -> None:
    for name in fields:
        if body.get(name):
            why = {
                "images": "is not supported: the served model reads text only",
                "template": "is not supported: the model's chat template is used (raw: true: none)",
                "context": "is not supported: send the conversation as /api/chat messages",
                "logprobs": "is not supported on this API (the OpenAI routes return logprobs)",
            }[name]
            raise _bad(name, why)


def chat_body(body: dict, model: str, limits) -> pb.GenerateRequest:
    _refuse_unsupported(body, ("logprobs",))
    openai = {
        "model": model,
        "messages": openai_messages(body.get("messages")),
        **openai_options(body),
    }
    if body.get("tools") is not None:
        openai["tools"] = body["tools"]
    return _translated(lambda b: chat_request(b, limits), openai)


def generate_body(body: dict, model: str, limits) -> pb.GenerateRequest:
    _refuse_unsupported(body, ("images", "template", "context", "logprobs"))
    prompt, system, suffix = body.get("prompt"), body.get("system"), body.get("suffix")
    if not isinstance(prompt, str):
        raise _bad("prompt", "must be a string")
    if system is not None and not isinstance(system, str):
        raise _bad("system", "must be a string")
    if suffix is not None and not isinstance(suffix, str):
        raise _bad("suffix", "must be a string")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise _bad("raw", "must be true or false")
    openai = {"model": model, **openai_options(body)}
    if suffix:  # fill-in-the-middle: the prompt is the code before the cursor, in the model's FIM format
        if system:
            raise _bad("system", "is not used with suffix (a fill-in-the-middle prompt has no system turn)")
        body_ = {**openai, "prompt": prompt, "suffix": suffix}
        return _translated(lambda b: completion_requests(b, limits)[0], body_)
    if raw:  # the prompt as it is: no template
        return _translated(lambda b: completion_requests(b, limits)[0], {**openai, "prompt": prompt})
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return _translated(lambda b: chat_request(b, limits), {**openai, "messages": messages})


# --- replies --------------------------------------------------------------------------------------


class _Reply:
    """The stream's messages as Ollama's objects, for /api/chat (``message``) or /api/generate
    (``response``), with the counts and durations of the last."""

    def __init__(self, chat: bool, model: str, stream: bool, thinking: bool = True) -> None:
        self.chat, self.model, self.stream = chat, model, stream
        self.show_thinking = thinking  # think: false: the model's thinking is not returned
        self.started = time.monotonic_ns()
        self.first: int | None = None
        self.text: list[str] = []
        self.thinking: list[str] = []
        self._whole = pb.GenerateResponse()
        self.calls = self._whole.tool_calls  # whole calls, merged from the stream's pieces
        self.finish = 0
        self.usage = pb.Usage()

    def _body(self, content: str, thinking: str, calls=None) -> dict:
        out: dict = {"model": self.model, "created_at": _now()}
        thinking = thinking if self.show_thinking else ""
        if self.chat:
            message: dict = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        return out

    def add(self, msg: pb.GenerateResponse) -> dict | None:
        """One stream message; the chunk to send for it (None: nothing to show yet)."""
        if self.first is None:
            self.first = time.monotonic_ns()
        merge_tool_calls(self.calls, msg.tool_calls)
        if msg.finish_reason:
            self.finish = msg.finish_reason
            self.usage.CopyFrom(msg.usage)
        if not self.stream:
            self.text.append(msg.text)
            self.thinking.append(msg.reasoning_content)
            return None
        if not msg.text and not (msg.reasoning_content and self.show_thinking):
            return None
        return {**self._body(msg.text, msg.reasoning_content), "done": False}

    def final(self) -> dict:
        end = time.monotonic_ns()
        first = self.first or end
        calls = [{"function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in self.calls]
        content = "" if self.stream else "".join(self.text)
        out = self._body(content, "" if self.stream else "".join(self.thinking), calls)
        out.update(
            done=True,
            done_reason=DONE_REASON.get(self.finish, "stop"),
            total_duration=end - self.started,
            load_duration=0,
            prompt_eval_count=self.usage.prompt_tokens,
            prompt_eval_duration=first - self.started,
            eval_count=self.usage.completion_tokens,
            eval_duration=end - first,
        )
        return out


def _arguments(text: str):
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {}


class _Lines(Encoder):
    """Ollama's stream: an object per message that shows something, the last with ``done``; an
    error after the stream began is one ``{"error"}`` line, and the stream ends there."""

    def __init__(self, reply: _Reply) -> None:
        self.reply = reply

    def message(self, p: int, msg: pb.GenerateResponse) -> list[Item]:
        chunk = self.reply.add(msg)
        return [] if chunk is None else [chunk]

    def end(self) -> list[Item]:
        return [self.reply.final()]

    def error(self, e: RequestError) -> list[Item]:
        return [{"error": json.loads(ollama_error(e).body)["error"]}]

    def refusal(self, e: RequestError) -> Response:
        return ollama_error(e)


# --- routes ---------------------------------------------------------------------------------------


def routes(api) -> list[Route]:
    """The routes, registered by ``gateway.http_api.HttpApi`` (its auth and body reading)."""
    s = api.s
    embeddings = EmbeddingService(s, api.service)

    def served(name) -> str:
        if name is None:
            return ""
        if not isinstance(name, str):
            raise _bad("model", "must be a string")
        name = name.removesuffix(":latest")  # Ollama's default tag; /api/tags lists the name with it
        if not s.lora_for_model(name):  # a LoRA adapter's name is checked by the engine
            s.check_model(name)
        return name

    def tagged() -> str:
        return s.model_name if ":" in s.model_name else f"{s.model_name}:latest"

    def details() -> dict:
        """The engine's facts about the served files (engine_svc/model_card.py), as Ollama lists them."""
        info = s.engine.info
        family = info.model_family if info else ""
        return {
            "parent_model": "",
            "format": info.model_format if info else "",
            "family": family,
            "families": [family] if family else None,
            "parameter_size": info.parameter_size if info else "",
            "quantization_level": info.quantization_level if info else "",
        }

    def size() -> int:
        info = s.engine.info
        return info.model_size_bytes if info else 0

    def guarded(handler, method: str = "POST"):
        async def checked(request: Request, identity: Identity, body) -> Response:
            if method == "POST" and not isinstance(body, dict):
                raise _bad("body", "must be a JSON object")
            return await handler(request, identity, body)

        async def endpoint(request: Request) -> Response:
            return await api._guarded(request, checked, ollama_error)

        return endpoint

    async def generation(request: Request, identity: Identity, body: dict, chat: bool) -> Response:
        s.check_serving()
        model = served(body.get("model"))
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise _bad("stream", "must be true or false")
        empty = not body.get("messages") if chat else not (body.get("prompt") or body.get("suffix"))
        if empty and not (not chat and body.get("system")):  # Ollama's "load the model" request
            out = {"model": model or s.model_name, "created_at": _now(), "done": True, "done_reason": "load"}
            out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
            return JSONResponse(out)
        thinking = _think(
            body.get("think"), body.get("model") or tagged(), bool(s.tool_options.reasoning_parser)
        )
        req = chat_body(body, model, s.limits) if chat else generate_body(body, model, s.limits)
        switch_thinking(req, body.get("think"), s.tokenizer is not None and s.tokenizer.has_thinking_switch)
        lora = s.lora_for_model(model)
        if lora:
            req.model, req.lora = "", lora
        reply = _Reply(chat, body.get("model") or tagged(), stream, thinking)
        if stream:
            options = {"fill_context": True, "tool_names": HTTP_NAMES}
            return StreamedResponse(api.service, identity, [(req, options)], _Lines(reply), NDJSON)
        async for msg in api.service.run(
            req, identity, client=peer(request.scope), fill_context=True, tool_names=HTTP_NAMES
        ):
            reply.add(msg)
        return JSONResponse(reply.final())

    async def chat(request, identity, body):
        return await generation(request, identity, body, chat=True)

    async def generate(request, identity, body):
        return await generation(request, identity, body, chat=False)

    async def embed(request, identity, body, legacy: bool = False):
        s.check_serving()
        started = time.monotonic_ns()
        model = served(body.get("model"))
        req = epb.EmbedRequest(model=model, normalize=not legacy)  # Ollama's legacy route: unnormalised
        field = "prompt" if legacy else "input"
        value = body.get(field)
        if legacy:
            if not isinstance(value, str) or not value:
                raise _bad("prompt", "must be a non-empty string")
            req.inputs.add(text=value)
        else:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
                raise _bad("input", "must be a string or a non-empty list of strings")
            for x in items:
                req.inputs.add(text=x)
        dimensions = body.get("dimensions")
        if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)):
            raise _bad("dimensions", "must be an integer")
        if body.get("truncate") is not None and not isinstance(body["truncate"], bool):
            raise _bad("truncate", "must be true or false")
        sinks = await embeddings.embed(req, identity, client=peer(request.scope), field=field)
        vectors = [vector(x) for x in sinks]
        for v in vectors:
            check_dimensions(dimensions, len(v))
        if legacy:
            return JSONResponse({"embedding": vectors[0].tolist()})
        return JSONResponse(
            {
                "model": body.get("model") or tagged(),
                "embeddings": [v.tolist() for v in vectors],
                "total_duration": time.monotonic_ns() - started,
                "load_duration": 0,
                "prompt_eval_count": sum(x.prompt_tokens for x in sinks),
            }
        )

    async def legacy_embeddings(request, identity, body):
        return await embed(request, identity, body, legacy=True)

    async def digest() -> str:
        return await s.model_digest.get() if s.model_digest is not None else ""

    async def tags(request, identity, body):
        card = {
            "name": tagged(),
            "model": tagged(),
            "modified_at": _STARTED,
            "size": size(),
            "digest": await digest(),
            "details": details(),
        }
        return JSONResponse({"models": [card]})

    async def ps(request, identity, body):
        info = s.engine.info
        card = {
            "name": tagged(),
            "model": tagged(),
            "size": size(),
            "digest": await digest(),
            "details": details(),
            "expires_at": "2318-01-01T00:00:00Z",  # served until the server stops: no keep_alive
            "size_vram": 0,
            "context_length": info.max_model_len if info else 0,
        }
        return JSONResponse({"models": [card] if s.engine.ready else []})

    async def show(request, identity, body):
        name = body.get("model") or body.get("name")
        served(name if name is not None else "")
        info = s.engine.info
        if info is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the engine has not connected yet")
        capabilities = ["completion", "embedding"]
        if s.tool_options.enable_auto_tool_choice:
            capabilities.append("tools")
        if s.tool_options.reasoning_parser:
            capabilities.append("thinking")
        family = info.model_family or "llmserve"
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                # The model's chat template as it is (Jinja, where Ollama's own are Go templates).
                "template": s.tokenizer.chat_template_text if s.tokenizer is not None else "",
                "details": details(),
                # "<general.architecture>.context_length" is where Ollama clients read the context size.
                "model_info": {
                    "general.architecture": family,
                    "general.name": s.model_name,
                    "general.parameter_count": info.parameter_count,
                    f"{family}.context_length": info.max_model_len,
                    f"{family}.vocab_size": info.vocab_size,
                },
                "capabilities": capabilities,
                "modified_at": _STARTED,
            }
        )

    async def version(request, identity, body):
        return JSONResponse({"version": _VERSION})

    return [
        Route("/api/chat", guarded(chat), methods=["POST"]),
        Route("/api/generate", guarded(generate), methods=["POST"]),
        Route("/api/embed", guarded(embed), methods=["POST"]),
        Route("/api/embeddings", guarded(legacy_embeddings), methods=["POST"]),
        Route("/api/show", guarded(show), methods=["POST"]),
        Route("/api/tags", guarded(tags, "GET"), methods=["GET"]),
        Route("/api/ps", guarded(ps, "GET"), methods=["GET"]),
        Route("/api/version", guarded(version, "GET"), methods=["GET"]),
    ]


_STARTED = _now()  # the served model's "modified_at": when this server process loaded this module
try:
    _VERSION = metadata.version("llmserve")
except metadata.PackageNotFoundError:
    _VERSION = "0.0.0"
