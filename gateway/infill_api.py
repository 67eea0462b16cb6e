"""llama.cpp's ``POST /infill`` (editor plugins such as llama.vscode speak it): fill in the middle.

The body (``input_prefix``, ``input_suffix``, ``input_extra`` = [{filename, text}], ``prompt``: text
already chosen at the cursor, and the ``/completion`` sampling options) becomes a
``GenerateRequest`` whose prompt is ``infill``; the gateway lays it out in the served model's own FIM
format (gateway/infill.py) and it runs through ``GenerationService.run``, the one generation path
(admission, metrics, cancel on disconnect: an editor that drops the previous keystroke's request
stops it). The reply is llama.cpp's ``/completion`` object (``content``, ``stop``, ``stop_type``,
``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``, ``timings``), streamed as server-sent
events (each ``data:`` a piece of ``content``, the last with ``stop: true``) when ``stream`` is true.
Unset, sampling takes llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) and
``n_predict`` -1 is the rest of the context. Options about llama.cpp's own slots and caches
(``cache_prompt``, ``id_slot``, ``samplers``, ``t_max_predict_ms``...) are ignored; ``n_indent`` is
llama.cpp's indentation rule, our ``stop_at: "block"`` with ``stop_indent`` (tokenizer_svc/code_stop.py's
rules, with ``stop_at``, ``stop_indent`` and ``supersede_key`` as on /v1/completions).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api_stream import run_whole
from gateway.errors import RequestError
from gateway.infill import InfillNames
from gateway.openai_protocol import CODE_FIELDS, BodyReader, code_options, fim_order, status_of
from gateway.streamed_response import SSE, Encoder, Item, StreamedResponse
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

FIELDS = {
    "input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "temperature", "top_k",
    "top_p", "min_p", "stop", "seed", "stream", "repeat_penalty", "presence_penalty",
    "frequency_penalty", "ignore_eos", "return_tokens", "n_probs", "model", "id_slot",
    "cache_prompt", "samplers", "t_max_predict_ms", "n_indent", "n_keep", "repeat_last_n", "speculative",
} | CODE_FIELDS  # fmt: skip
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
NAMES = InfillNames(
    whole="input_prefix",
    prefix="input_prefix",
    suffix="input_suffix",
    files="input_extra",
    middle="prompt",
    order="fim_order",
)
# The proto's names of sampling fields -> llama.cpp's.
_RENAMES = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "text": "input_prefix"}


def error(e: RequestError, status: int | None = None) -> JSONResponse:
    """llama.cpp's error shape; a violation's field as llama.cpp spells it."""
    status = status or status_of(e.code)
    if e.violations:
        message = "; ".join(f"{_RENAMES.get(v.field, v.field)}: {v.description}" for v in e.violations)
    else:
        message = e.message
    kind = "invalid_request_error" if status == 400 else "server_error" if status >= 500 else "error"
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s is not None else {}
    return JSONResponse(
        {"error": {"code": status, "message": message, "type": kind}}, status_code=status, headers=headers
    )


def infill_request(body) -> pb.GenerateRequest:
    """The body as a GenerateRequest; every type error at once, named as llama.cpp names it."""
    r = BodyReader(body, FIELDS, "infill")
    req = pb.GenerateRequest(model=r.str("model") or "")
    req.infill.prefix = r.str("input_prefix") or ""
    req.infill.suffix = r.str("input_suffix") or ""
    req.infill.middle = r.str("prompt") or ""
    extra = r.get("input_extra", lambda x: isinstance(x, list), "a list of {filename, text}")
    for i, chunk in enumerate(extra or []):
        if (
            not isinstance(chunk, dict)
            or not isinstance(chunk.get("filename", ""), str)
            or not isinstance(chunk.get("text"), str)
        ):
            r.bad(f"input_extra[{i}]", "must be {filename: string, text: string}")
            break
        req.infill.files.add(path=chunk.get("filename") or "", text=chunk["text"])
    for name, field in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("min_p", "min_p"),
        ("repeat_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ):
        value = r.num(name)
        if value is None:
            value = DEFAULTS.get(name)
        if value is not None:
            setattr(req, field, value)
    top_k = r.int("top_k", None)
    top_k = DEFAULTS["top_k"] if top_k is None else top_k
    req.top_k = min(max(top_k, 0), 2**31 - 1)  # llama.cpp: <= 0 is off
    n_predict = r.int("n_predict", None)
    if n_predict is not None:
        if n_predict == 0 or n_predict < -1:
            r.bad("n_predict", f"must be > 0, or -1 for the rest of the context; got {n_predict}")
        elif n_predict > 0:
            req.max_tokens = min(n_predict, 2**32 - 1)
    seed = r.int("seed", None)
    if seed is not None and seed not in (-1, 0xFFFFFFFF):  # llama.cpp's "random"
        req.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop.extend(stop)
    elif stop is not None:
        r.bad("stop", "must be a list of strings")
    code_options(r, req)
    order = fim_order(r)
    if order is not None:
        req.infill.order = order
    n_indent = r.int("n_indent", None)
    if n_indent is not None and n_indent > 0 and not req.stop_at:
        # llama.cpp's rule: a later line indented less than n_indent ends the output.
        req.stop_at, req.stop_indent = pb.STOP_AT_BLOCK, min(n_indent, 2**32 - 1)
    speculative = r.bool("speculative")  # ours: false, this request never drafts
    if speculative is not None:
        req.speculative = speculative
    if r.bool("ignore_eos"):
        req.ignore_eos = True
    if r.bool("return_tokens"):
        req.return_token_ids = True
    n_probs = r.int("n_probs")
    if n_probs:
        r.bad("n_probs", "is not supported on /infill (the OpenAI routes return logprobs)")
    r.bool("stream")
    r.done()
    return req


class _Reply:
    """The stream's messages as llama.cpp's /completion objects."""

    def __init__(self, model: str, stream: bool) -> None:
        self.model, self.stream = model, stream
        self.started = time.monotonic()
        self.first: float | None = None
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.last: pb.GenerateResponse | None = None

    def add(self, msg: pb.GenerateResponse) -> dict | None:
        if self.first is None:
            self.first = time.monotonic()
        self.text.append(msg.text)
        self.tokens += msg.token_ids
        if msg.finish_reason:
            self.last = msg
        if self.stream and (msg.text or msg.token_ids):
            return {
                "index": 0,
                "content": msg.text,
                "tokens": list(msg.token_ids),
                "stop": False,
                "id_slot": 0,
            }
        return None

    def final(self) -> dict:
        end = time.monotonic()
        first = self.first or end
        last = self.last or pb.GenerateResponse()
        usage = last.usage
        which = last.WhichOneof("stop_reason")
        if last.finish_reason == pb.FINISH_REASON_LENGTH:
            stop_type = "limit"
        elif last.finish_reason == pb.FINISH_REASON_STOP:
            # llama.cpp's indentation rule says "limit"; so do ours (stop_at).
            stop_type = "word" if which == "stop_string" else "limit" if which == "stop_rule" else "eos"
        else:
            stop_type = "none"
        computed = usage.prompt_tokens - usage.cached_prompt_tokens
        predicted_ms = (end - first) * 1000
        content = "" if self.stream else "".join(self.text)
        return {
            "index": 0,
            "content": content,
            "tokens": [] if self.stream else self.tokens,
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_prompt_tokens,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": last.stop_string if which == "stop_string" else "",
            "has_new_line": "\n" in "".join(self.text),
            "timings": {
                "prompt_n": computed,
                "prompt_ms": (first - self.started) * 1000,
                "predicted_n": usage.completion_tokens,
                "predicted_ms": predicted_ms,
                "predicted_per_second": usage.completion_tokens / (predicted_ms / 1000)
                if predicted_ms
                else 0,
                # as llama.cpp reports its speculation: drafted tokens, and of them accepted
                "draft_n": usage.draft_tokens,
                "draft_n_accepted": usage.accepted_draft_tokens,
            },
        }


class _Events(Encoder):
    def __init__(self, reply: _Reply) -> None:
        self.reply = reply

    def message(self, p: int, msg: pb.GenerateResponse) -> list[Item]:
        chunk = self.reply.add(msg)
        return [] if chunk is None else [chunk]

    def end(self) -> list[Item]:
        return [self.reply.final()]

    def error(self, e: RequestError) -> list[Item]:
        return [{"error": {"code": status_of(e.code), "message": e.message}}]

    def refusal(self, e: RequestError) -> Response:
        return error(e)


async def respond(api, request: Request, identity, body) -> Response:
    s = api.s
    s.check_serving()
    req = infill_request(body)
    s.check_model(req.model)
    stream = body.get("stream") is True
    reply = _Reply(s.model_name, stream)
    options = {"fill_context": True, "infill_names": NAMES}
    if stream:
        return StreamedResponse(api.service, identity, [(req, options)], _Events(reply), SSE)
    # Not streamed: the whole reply. A client that leaves (an editor's next keystroke drops the
    # previous request) ends the run at once.
    if not await run_whole(api, request, identity, req, options, reply.add):
        return Response(status_code=499)  # nobody reads it: the client is gone
    return JSONResponse(reply.final())
