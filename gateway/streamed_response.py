"""One streamed HTTP response for every API: the generation path's messages sent as they come, in
server-sent events (OpenAI, Anthropic, Responses) or newline-delimited JSON (Ollama).

What an API makes of the stream is its ``Encoder`` (its objects before the first output, per
message, at the end, for an error after the stream began, and the plain error response for a
request refused before any output); how the objects are written on the wire is the ``Framing``.
Each message is sent once the generation path yields it, and the next is taken only once uvicorn
has written this one (its send waits while the socket buffer is full), so a client that stops
reading holds up its handler as gRPC's flow control does (paused in the engine, then ended by the
stall sweep). A client that disconnects cancels the handler task, whose generators abort their
engine requests.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.responses import Response

from gateway.errors import RequestError
from gateway.stall_sweep import StreamControl
from llmserve_proto.llmserve.v1 import generation_pb2 as pb

# An encoder's item: a JSON object (``data``), a named event ``(event, data)`` (server-sent events
# only), or text sent as the data as it is (OpenAI's ``[DONE]``).
Item = dict | tuple[str, dict] | str


@dataclass(frozen=True)
class Framing:
    content_type: bytes
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()
    sse: bool = True

    def frame(self, item: Item) -> bytes:
        if not self.sse:  # one JSON object a line
            return json.dumps(item).encode() + b"\n"
        if isinstance(item, str):
            return b"data: " + item.encode() + b"\n\n"
        if isinstance(item, tuple):
            event, data = item
            return f"event: {event}\ndata: {_compact(data)}\n\n".encode()
        return b"data: " + _compact(item).encode() + b"\n\n"

    def start(self) -> dict:
        headers = [(b"content-type", self.content_type), (b"cache-control", b"no-cache"), *self.extra_headers]
        return {"type": "http.response.start", "status": 200, "headers": headers}


def _compact(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


SSE = Framing(b"text/event-stream; charset=utf-8", ((b"x-accel-buffering", b"no"),))
NDJSON = Framing(b"application/x-ndjson", sse=False)


class Encoder:
    """What an API makes of a stream (lists of ``Item``); ``p`` is the prompt a message belongs to
    (OpenAI's completions take several prompts in one request)."""

    def start(self) -> list[Item]:
        return []

    def message(self, p: int, msg: pb.GenerateResponse) -> list[Item]:
        raise NotImplementedError

    def end(self) -> list[Item]:
        raise NotImplementedError

    def error(self, e: RequestError) -> list[Item]:
        """The items for an error after the stream began; the response ends after them."""
        raise NotImplementedError

    def refusal(self, e: RequestError) -> Response:
        """The plain error response for a request refused before any output."""
        raise NotImplementedError


class HttpStreamContext:
    """What the stall sweep needs of a call: ``abort`` (the stream is ended by closing it)."""

    async def abort(self, code, message):
        raise asyncio.CancelledError(message)


async def wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def peer(scope) -> str | None:
    """The client's connection (host:port), for admission's share kept for new clients."""
    client = scope.get("client")
    return f"http:{client[0]}:{client[1]}" if client else None


class StreamedResponse(Response):
    """``runs`` (each a ``GenerateRequest`` and its ``GenerationService.run`` options) streamed as
    one response through ``encoder``, written in ``framing``. The response starts with the first
    bytes there are to send; a refusal before that is the encoder's plain error response."""

    def __init__(self, service, identity, runs: list[tuple], encoder: Encoder, framing: Framing) -> None:
        super().__init__(status_code=200)
        self.service, self.identity, self.runs = service, identity, runs
        self.encoder, self.framing = encoder, framing

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        state = {"done": False, "disconnected": False}

        async def watch() -> None:
            await wait_disconnect(receive)
            if not state["done"]:
                state["disconnected"] = True
                task.cancel()

        started = begun = False

        async def body(items: list[Item], more: bool = True) -> None:
            nonlocal started
            data = b"".join(self.framing.frame(x) for x in items)
            if not data and more:
                return
            if not started:
                await send(self.framing.start())
                started = True
            await send({"type": "http.response.body", "body": data, "more_body": more})

        controls, gens = [], []
        for req, options in self.runs:
            control = StreamControl(task, HttpStreamContext(), log_id="")
            controls.append(control)
            gens.append(self.service.run(req, self.identity, control=control, client=peer(scope), **options))
        watcher = asyncio.ensure_future(watch())
        try:
            merged = merge(gens) if len(gens) > 1 else single(gens[0])
            try:
                async for p, msg in merged:
                    items = [] if begun else self.encoder.start()
                    begun = True
                    await body(items + self.encoder.message(p, msg))
            except RequestError as e:
                state["done"] = True
                if not started:  # refused before any output: a plain error response
                    await self.encoder.refusal(e)(scope, receive, send)
                    return
                await body(self.encoder.error(e), more=False)
                return
            finally:
                await merged.aclose()
            state["done"] = True
            await body(([] if begun else self.encoder.start()) + self.encoder.end(), more=False)
        except asyncio.CancelledError:
            if state["disconnected"] or any(c.stalled for c in controls):
                return  # the connection is gone or is being dropped; the engine requests were aborted
            raise
        finally:
            state["done"] = True
            watcher.cancel()


async def single(gen):
    try:
        async for msg in gen:
            yield 0, msg
    finally:
        await gen.aclose()


async def merge(gens):
    """Several prompts' streams as one, in arrival order; each pump waits until its message is taken."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    END = object()

    async def pump(p: int, gen) -> None:
        try:
            async for msg in gen:
                await queue.put((p, msg))
        except asyncio.CancelledError:
            raise  # the consumer is gone: nobody would take a report
        except Exception as e:  # handed to the consumer
            await queue.put((p, e))
            return
        finally:
            await gen.aclose()
        await queue.put((p, END))

    tasks = [asyncio.ensure_future(pump(p, g)) for p, g in enumerate(gens)]
    live = len(tasks)
    try:
        while live:
            p, item = await queue.get()
            if item is END:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield p, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
