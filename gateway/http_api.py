"""The OpenAI-compatible HTTP API (``--http-port``): Starlette on uvicorn, on the gateway's own loop.

Every generation runs through ``GenerationService.run``, the code the gRPC ``GenerateStream`` runs
(validation, admission and queue limits, the tenant's cache salt, metrics, logging, backpressure,
drain); this module only translates JSON to ``GenerateRequest`` and the stream's messages back to
OpenAI's shapes. A client that disconnects cancels its handler, whose ``finally`` aborts the engine
request, as a gRPC cancel does. uvicorn's writes wait while the socket's buffer is full, so a client
that stops reading holds up its handler exactly as gRPC's flow control does (paused in the engine,
then ended by the stall sweep).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import embeddings_api, infill_api, ollama_api
from gateway.anthropic_api import AnthropicApi
from gateway.auth import Identity
from gateway.errors import FieldViolation, RequestError, invalid
from gateway.gateway_state import GatewayState
from gateway.generation_service import GenerationService, merge_tool_calls
from gateway.infill import InfillNames
from gateway.openai_protocol import (
    FINISH,
    TOKENIZE_FIELDS,
    BodyReader,
    BodyTooLarge,
    chat_request,
    completion_requests,
    error_body,
    read_message,
    read_tools,
    status_of,
)
from gateway.responses_api import ResponsesApi
from gateway.streamed_response import SSE, Encoder, Item, StreamedResponse, peer, wait_disconnect
from gateway.token_only import refuse_text_call
from gateway.tool_request import HTTP_NAMES
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

log = logging.getLogger("gateway.http")
# `suffix` on completions: the prompt is the prefix, and the refusals name these fields.
COMPLETION_INFILL_NAMES = InfillNames(whole="suffix", prefix="prompt", suffix="suffix", order="fim_order")


class HttpApi:
    def __init__(self, state: GatewayState, service: GenerationService) -> None:
        self.s = state
        self.service = service
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/infill", self.infill, methods=["POST"]),  # llama.cpp's fill-in-the-middle
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                *embeddings_api.routes(self),  # /v1/embeddings
                *ollama_api.routes(self),  # /api/chat, /api/generate, /api/embed, ... (Ollama's API)
                *AnthropicApi(self).routes(),  # /v1/messages: Claude Code, the anthropic SDKs
                *ResponsesApi(self).routes(),  # /v1/responses: Codex, the openai-agents SDK
            ],
        )

    # --- plumbing ---------------------------------------------------------------------------------

    def _identity(self, request: Request) -> Identity:
        identity = self.s.auth.identify_http(request.headers.items())
        if identity is None:
            self.s.metrics.auth_failures.inc()
            token = request.headers.get("authorization") or request.headers.get("x-api-key")
            reason = "missing credentials" if not token else "invalid API key"
            log.warning("refused %s: %s", request.url.path, reason)
            raise RequestError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{reason}: send 'Authorization: Bearer <API key>' (or 'x-api-key: <API key>')",
            )
        return identity

    async def _body(self, request: Request):
        cap = self.s.limits.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise BodyTooLarge(cap)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise BodyTooLarge(cap)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise invalid([FieldViolation("body", f"is not valid JSON: {str(e)[:100]}")]) from None

    @staticmethod
    def _error(e: RequestError, status: int | None = None) -> JSONResponse:
        status = status or status_of(e.code)
        headers = {}
        if e.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(e.retry_after_s)))
        return JSONResponse(error_body(e, status), status_code=status, headers=headers)

    async def _guarded(self, request: Request, handler, error=None) -> Response:
        """``handler(request, identity, body)`` with the caller's credentials checked and the body
        read (POST), every refusal answered in the API's own error shape: ``error(e, status=None)``
        (default OpenAI's)."""
        error = error or self._error
        try:
            identity = self._identity(request)
            body = await self._body(request) if request.method == "POST" else None
            return await handler(request, identity, body)
        except BodyTooLarge as e:
            err = RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request body is over {e.cap} bytes (max_message_bytes)",
                [FieldViolation("body", f"the limit is max_message_bytes={e.cap}")],
            )
            return error(err, 413)
        except RequestError as e:
            return error(e)
        except Exception:  # a bug: still the API's shape, and the traceback in the log
            log.exception("HTTP request failed: %s", request.url.path)
            return error(RequestError(grpc.StatusCode.INTERNAL, "internal error"), 500)

    # --- generation -------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._guarded(request, self._completions)

    async def chat_completions(self, request: Request) -> Response:
        return await self._guarded(request, self._chat)

    async def infill(self, request: Request) -> Response:
        return await self._guarded(request, self._infill, infill_api.error)

    async def _completions(self, request: Request, identity: Identity, body) -> Response:
        reqs = completion_requests(body, self.s.limits)
        return await self._respond(request, identity, body, reqs, chat=False)

    async def _infill(self, request: Request, identity: Identity, body) -> Response:
        """llama.cpp's ``/infill`` (gateway/infill_api.py)."""
        return await infill_api.respond(self, request, identity, body)

    async def _chat(self, request: Request, identity: Identity, body) -> Response:
        if self.s.token_only:  # before the body is read as a chat: there is no template to render it
            refuse_text_call("messages", "chat completions (the chat template)")
        req = chat_request(body, self.s.limits)
        return await self._respond(request, identity, body, [req], chat=True)

    async def _respond(self, request: Request, identity, body, reqs, chat: bool) -> Response:
        self.s.check_serving()  # before a 200 is sent: a drain or a lost engine is a 503
        model = self.s.model_name
        lora = self.s.lora_for_model(reqs[0].model)
        if lora:  # as vLLM: `model` names a LoRA adapter (the engine says NOT_FOUND if it is not one)
            model = lora
            for r in reqs:
                r.model, r.lora = "", lora
        self.s.check_model(reqs[0].model)
        n = reqs[0].n if reqs[0].HasField("n") else 1
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + (reqs[0].request_id or uuid.uuid4().hex),
            "created": int(time.time()),
            "model": model,
        }
        fmt = _Formatter(self.s.tokenizer, chat, meta, n, reqs[0].return_token_ids)
        if reqs[0].WhichOneof("prompt") == "infill":  # `suffix`: violations name this API's fields
            fmt.infill_names = COMPLETION_INFILL_NAMES
        if body.get("stream"):
            options = body.get("stream_options") or {}
            runs = [(r, fmt.run_options(p)) for p, r in enumerate(reqs)]
            events = _ChatEvents(fmt, bool(options.get("include_usage")))
            return StreamedResponse(self.service, identity, runs, events, SSE)
        return await self._whole(request, identity, reqs, fmt)

    async def _whole(self, request: Request, identity, reqs, fmt: _Formatter) -> Response:
        """Not streamed: every prompt's stream collected; the first error, or the client leaving,
        cancels them all (their engine requests are aborted)."""

        async def one(p: int, req: pb.GenerateRequest) -> None:
            async for msg in self.service.run(
                req, identity, client=peer(request.scope), **fmt.run_options(p)
            ):
                fmt.add(p, msg)

        tasks = [asyncio.ensure_future(one(p, r)) for p, r in enumerate(reqs)]
        watcher = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            pending = set(tasks)
            while pending:
                done, _ = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    return Response(status_code=499)  # nobody reads it: the client is gone
                for t in done:
                    pending.discard(t)
                    t.result()  # the first refusal or failure
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return JSONResponse(fmt.whole())

    # --- models, health, tokenize -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        async def handler(request, identity, body):
            info = self.s.engine.info
            card = {
                "id": self.s.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "llmserve",
                "root": self.s.model_name,
                "parent": None,
                "max_model_len": info.max_model_len if info else None,
            }
            return JSONResponse({"object": "list", "data": [card]})

        return await self._guarded(request, handler)

    async def health(self, request: Request) -> Response:
        # Exempt from keys, as gRPC's health is: probes carry no credentials.
        ok = not self.s.draining and self.s.engine.ready
        return Response(status_code=200 if ok else 503)

    async def tokenize(self, request: Request) -> Response:
        async def handler(request, identity, body):
            if not isinstance(body, dict):
                raise invalid([FieldViolation("body", "must be a JSON object")])
            if self.s.token_only:  # named by this API's field, not the gRPC one
                refuse_text_call("messages" if "messages" in body else "prompt", "tokenizing")
            req = pb.TokenizeRequest(model=body.get("model") or "")
            if isinstance(body.get("add_special_tokens"), bool):
                req.add_special_tokens = body["add_special_tokens"]
            if isinstance(body.get("prompt"), str):
                req.text = body["prompt"]
            elif isinstance(body.get("messages"), list):
                msgs = body["messages"]
                if len(msgs) > self.s.limits.max_chat_messages:
                    raise invalid([FieldViolation("messages", "over max_chat_messages")])
                r = BodyReader(body, TOKENIZE_FIELDS, "tokenize")
                for i, m in enumerate(msgs):  # as a chat request's: tool calls, tool results
                    if not read_message(r, i, m, req.chat.messages.add()):
                        break
                read_tools(r, req.chat)  # rendered by the template, as a chat request's would be
                r.done()
                if isinstance(body.get("add_generation_prompt"), bool):
                    req.chat.add_generation_prompt = body["add_generation_prompt"]
            else:
                raise invalid([FieldViolation("prompt", "a string prompt or a list of messages is required")])
            out = await self.service.tokenize(req)
            return JSONResponse(
                {"count": out.count, "max_model_len": out.max_model_len, "tokens": list(out.token_ids)}
            )

        return await self._guarded(request, handler)

    async def detokenize(self, request: Request) -> Response:
        async def handler(request, identity, body):
            if self.s.token_only:
                refuse_text_call("tokens", "detokenizing")
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and -(2**31) <= t < 2**31 for t in tokens
            ):
                raise invalid([FieldViolation("tokens", "must be a list of token ids")])
            out = await self.service.detokenize(
                pb.DetokenizeRequest(model=body.get("model") or "", token_ids=tokens)
            )
            return JSONResponse({"prompt": out.text})

        return await self._guarded(request, handler)


class _Formatter:
    """The stream's messages as OpenAI choices: choice index = prompt * n + sequence index."""

    def __init__(self, tokenizer, chat: bool, meta: dict, n: int, prompt_ids: bool = False) -> None:
        self.tok = tokenizer
        self.want_prompt_ids = prompt_ids  # return_token_ids: the prompt's ids too (vLLM's shape)
        self.prompt_ids: dict[int, list[int]] = {}
        self.chat = chat
        self.meta = meta
        self.n = n
        self.choices: dict[int, dict] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        self._token_cache: dict[int, str] = {}
        self.infill_names: InfillNames | None = None

    def run_options(self, p: int) -> dict:
        """What ``GenerationService.run`` takes for prompt ``p`` of this request."""

        def keep(ids: list[int]) -> None:
            self.prompt_ids[p] = list(ids)

        options = {"fill_context": True, "on_prompt": keep if self.want_prompt_ids else None}
        if self.infill_names is not None:
            options["infill_names"] = self.infill_names
        if self.chat:
            options["tool_names"] = HTTP_NAMES  # violations name this API's fields
        return options

    def _token(self, tid: int) -> str:
        s = self._token_cache.get(tid)
        if s is None and self.tok is None:  # token-only mode: vLLM's "token_id:N" spelling
            s = self._token_cache[tid] = f"token_id:{tid}"
        if s is None:
            s = self._token_cache[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return s

    def _logprobs(self, lps) -> list[dict]:
        out = []
        for lp in lps:
            t = self._token(lp.token_id)
            entry = {
                "token": t,
                "logprob": _finite(lp.logprob),
                "bytes": list(t.encode()),
                "top_logprobs": [],
            }
            for top in lp.top:
                tt = self._token(top.token_id)
                entry["top_logprobs"].append(
                    {"token": tt, "logprob": _finite(top.logprob), "bytes": list(tt.encode())}
                )
            out.append(entry)
        return out

    def _completion_logprobs(self, lps, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            t = self._token(lp.token_id)
            out["tokens"].append(t)
            out["token_logprobs"].append(_finite(lp.logprob))
            out["top_logprobs"].append({self._token(top.token_id): _finite(top.logprob) for top in lp.top})
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    def _usage_of(self, p: int, msg: pb.GenerateResponse) -> None:
        if msg.finish_reason:
            self.prompt_tokens[p] = msg.usage.prompt_tokens
            self.cached_tokens[p] = max(self.cached_tokens.get(p, 0), msg.usage.cached_prompt_tokens)
            self.completion_tokens += msg.usage.completion_tokens

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    @staticmethod
    def _stop_reason(msg: pb.GenerateResponse):
        which = msg.WhichOneof("stop_reason")
        return getattr(msg, which) if which else None

    # not streamed
    def add(self, p: int, msg: pb.GenerateResponse) -> None:
        index = p * self.n + msg.index
        c = self.choices.setdefault(
            index,
            {
                "text": "",
                "ids": [],
                "lps": [],
                "plps": [],
                "msg": None,
                "calls": pb.GenerateResponse(),
                "thought": "",
            },
        )
        c["text"] += msg.text
        c["thought"] += msg.reasoning_content
        merge_tool_calls(c["calls"].tool_calls, msg.tool_calls)
        c["ids"] += msg.token_ids
        c["lps"] += msg.logprobs
        c["plps"] += msg.prompt_logprobs
        if msg.finish_reason:
            c["msg"] = msg
        self._usage_of(p, msg)

    def whole(self) -> dict:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            last = c["msg"]
            want_lps = bool(c["lps"])
            choice: dict = {"index": index}
            if self.chat:
                message: dict = {"role": "assistant", "content": c["text"]}
                calls = c["calls"].tool_calls
                if calls:
                    message["content"] = c["text"] or None
                    message["tool_calls"] = [
                        {
                            "id": t.id,
                            "type": "function",
                            "function": {"name": t.name, "arguments": t.arguments},
                        }
                        for t in calls
                    ]
                if c["thought"]:
                    message["reasoning_content"] = c["thought"]
                choice["message"] = message
                choice["logprobs"] = {"content": self._logprobs(c["lps"])} if want_lps else None
            else:
                choice["text"] = c["text"]
                choice["logprobs"] = self._completion_logprobs(c["lps"], 0) if want_lps else None
            choice["finish_reason"] = FINISH.get(last.finish_reason) if last else None
            choice["stop_reason"] = self._stop_reason(last) if last else None
            if self.want_prompt_ids and not self.chat:
                choice["prompt_token_ids"] = self.prompt_ids.get(index // self.n)
            if c["ids"]:
                choice["token_ids"] = list(c["ids"])
            if c["plps"]:
                choice["prompt_logprobs"] = [None] + [
                    {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank}} for lp in c["plps"]
                ]
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        out = {**self.meta, "object": kind, "choices": choices, "usage": self.usage()}
        if self.want_prompt_ids and self.chat:
            out["prompt_token_ids"] = self.prompt_ids.get(0)
        return out

    # streamed
    def chunk(self, p: int, msg: pb.GenerateResponse, first: bool) -> dict:
        index = p * self.n + msg.index
        self._usage_of(p, msg)
        choice: dict = {"index": index}
        if self.chat:
            delta: dict = {"role": "assistant", "content": msg.text} if first else {"content": msg.text}
            if msg.reasoning_content:
                delta["reasoning_content"] = msg.reasoning_content
            if msg.tool_calls:
                delta["tool_calls"] = [_call_delta(t) for t in msg.tool_calls]
            choice["delta"] = delta
            choice["logprobs"] = {"content": self._logprobs(msg.logprobs)} if msg.logprobs else None
        else:
            choice["text"] = msg.text
            choice["logprobs"] = self._completion_logprobs(msg.logprobs, 0) if msg.logprobs else None
        choice["finish_reason"] = FINISH.get(msg.finish_reason) if msg.finish_reason else None
        if msg.finish_reason:
            choice["stop_reason"] = self._stop_reason(msg)
        if first and self.want_prompt_ids and not self.chat:
            choice["prompt_token_ids"] = self.prompt_ids.get(p)
        if msg.token_ids:
            choice["token_ids"] = list(msg.token_ids)
        if msg.prompt_logprobs:
            choice["prompt_logprobs"] = [None] + [
                {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank}}
                for lp in msg.prompt_logprobs
            ]
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self.meta, "object": kind, "choices": [choice]}
        if first and self.want_prompt_ids and self.chat:
            out["prompt_token_ids"] = self.prompt_ids.get(p)
        return out

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.meta, "object": kind, "choices": [], "usage": self.usage()}


def _call_delta(t) -> dict:
    """OpenAI's streamed call shape: the first piece has index, id, type and name; the rest only
    the index and the next piece of the arguments."""
    if t.name:
        return {
            "index": t.index,
            "id": t.id,
            "type": "function",
            "function": {"name": t.name, "arguments": t.arguments},
        }
    return {"index": t.index, "function": {"arguments": t.arguments}}


def _finite(x: float) -> float:
    """JSON has no -inf: a masked token's logprob is reported as -9999.0, as vLLM does."""
    return x if x > -9999.0 else -9999.0


class _ChatEvents(Encoder):
    """OpenAI's stream: one ``data:`` chunk per message, the usage chunk if asked, ``[DONE]``; an
    error after the stream began is one more event, then the end."""

    def __init__(self, fmt: _Formatter, include_usage: bool) -> None:
        self.fmt, self.include_usage = fmt, include_usage
        self.seen: set[int] = set()  # choices that had their first chunk

    def message(self, p: int, msg: pb.GenerateResponse) -> list[Item]:
        key = p * self.fmt.n + msg.index
        first = key not in self.seen
        self.seen.add(key)
        return [self.fmt.chunk(p, msg, first)]

    def end(self) -> list[Item]:
        return ([self.fmt.usage_chunk()] if self.include_usage else []) + ["[DONE]"]

    def error(self, e: RequestError) -> list[Item]:
        return [error_body(e), *self.end()]

    def refusal(self, e: RequestError) -> Response:
        return HttpApi._error(e)


def ssl_options(tls) -> dict:
    """uvicorn's TLS settings from the gateway's ``ServerTLS`` (the same files as the gRPC port)."""
    if tls is None:
        return {}
    options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.client_ca:
        options.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class HttpServer:
    """uvicorn serving ``HttpApi`` as tasks on the running loop (no thread, no loop of its own, no
    signal handlers: the launcher's SIGTERM drain covers both APIs)."""

    def __init__(self, api: HttpApi, host: str, port: int, tls) -> None:
        import uvicorn

        self.config = uvicorn.Config(
            api.app,
            host=host,
            port=port,
            lifespan="off",
            log_config=None,
            access_log=False,
            http="h11",
            ws="none",
            timeout_graceful_shutdown=2,
            h11_max_incomplete_event_size=64 * 1024,
            **ssl_options(tls),
        )
        self.server = uvicorn.Server(self.config)
        self.port: int | None = None
        self._main: asyncio.Task | None = None

    async def start(self) -> int:
        config = self.config
        if not config.loaded:
            config.load()
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup()
        if self.server.should_exit:
            raise OSError(f"cannot listen on {config.host}:{config.port} (HTTP)")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self._main = asyncio.get_running_loop().create_task(self.server.main_loop(), name="http-main")
        return self.port

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._main is not None:
            await asyncio.gather(self._main, return_exceptions=True)
        await self.server.shutdown()
