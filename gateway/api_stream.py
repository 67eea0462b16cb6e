"""What the Anthropic Messages and OpenAI Responses adapters share: one request's run through the
generation path (``GenerationService.run``, as the chat completions route takes it), whole or as a
stream of server-sent events, and its output cut into the ordered blocks both APIs speak of
(reasoning, text, tool calls), so that a streamed reply and a whole one are built from the same
pieces.

A client that leaves cancels the run (its engine request is aborted); a stream whose client stops
reading is held up by uvicorn's send and ended by the stall sweep, as chat completions' are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.responses import Response

from gateway.errors import RequestError
from gateway.stall_sweep import StreamControl
from gateway.tool_request import Names
from llmserve_proto.llmserve.v1 import generation_pb2 as pb


@dataclass
class Block:
    kind: str  # "thinking" | "text" | "call"
    text: str = ""  # the thinking or text; a call's arguments (JSON text)
    call_id: str = ""
    name: str = ""


@dataclass
class Output:
    """One sequence's stream messages as blocks in order; ``feed`` says what each message changed:
    ``("open", i)``, ``("delta", i, piece)``, ``("close", i)`` for block ``i``."""

    blocks: list[Block] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish: int = 0  # pb.FinishReason; 0 until the last message
    stop_string: str | None = None
    _open: int | None = None
    _calls: dict[int, int] = field(default_factory=dict)  # call index -> block index

    def _to(self, kind: str, events: list) -> int:
        if self._open is not None and self.blocks[self._open].kind == kind and kind != "call":
            return self._open
        if self._open is not None:
            events.append(("close", self._open))
        self.blocks.append(Block(kind))
        self._open = len(self.blocks) - 1
        events.append(("open", self._open))
        return self._open

    def feed(self, msg: pb.GenerateResponse) -> list[tuple]:
        events: list[tuple] = []
        if msg.reasoning_content:
            i = self._to("thinking", events)
            self.blocks[i].text += msg.reasoning_content
            events.append(("delta", i, msg.reasoning_content))
        if msg.text:
            i = self._to("text", events)
            self.blocks[i].text += msg.text
            events.append(("delta", i, msg.text))
        for piece in msg.tool_calls:
            if piece.index not in self._calls:
                i = self._to("call", events)
                b = self.blocks[i]
                b.call_id, b.name = piece.id, piece.name
                self._calls[piece.index] = i
            i = self._calls[piece.index]
            self.blocks[i].text += piece.arguments
            if piece.arguments:
                events.append(("delta", i, piece.arguments))
        if msg.finish_reason:
            if self._open is not None:
                events.append(("close", self._open))
                self._open = None
            self.finish = msg.finish_reason
            self.prompt_tokens = msg.usage.prompt_tokens
            self.cached_tokens = msg.usage.cached_prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            if msg.WhichOneof("stop_reason") == "stop_string":
                self.stop_string = msg.stop_string
        return events


def run_options(names: Names, max_tokens: int | None, on_prompt: Callable | None = None) -> dict:
    """``GenerationService.run``'s options for these APIs: the unset max_tokens fills the context,
    held to the client's own ``max_tokens`` (clamped, not refused, where the context is smaller)."""
    return {
        "fill_context": True,
        "tool_names": names,
        "max_tokens_cap": max_tokens,
        "on_prompt": on_prompt,
    }


async def collect(api, request, identity, req: pb.GenerateRequest, options: dict) -> Output | None:
    """The whole output of one request (None: the client left, and the run was cancelled)."""
    from gateway.http_api import _peer, _wait_disconnect

    out = Output()

    async def one() -> None:
        async for msg in api.service.run(req, identity, client=_peer(request.scope), **options):
            out.feed(msg)

    task = asyncio.ensure_future(one())
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            return None
        task.result()  # a refusal or failure
        return out
    finally:
        watcher.cancel()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def sse(event: str, data: dict) -> bytes:
    """A named server-sent event (both APIs name theirs after the ``type`` in the data)."""
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {body}\n\n".encode()


class Encoder:
    """What an API makes of a stream: its events before the first output, per message, at the end,
    and for an error after the stream began; ``refusal`` is the plain error response for a request
    refused before any output."""

    def start(self) -> list[bytes]:
        raise NotImplementedError

    def message(self, msg: pb.GenerateResponse) -> list[bytes]:
        raise NotImplementedError

    def end(self) -> list[bytes]:
        raise NotImplementedError

    def error(self, e: RequestError) -> bytes:
        raise NotImplementedError

    def refusal(self, e: RequestError) -> Response:
        raise NotImplementedError


class EventStream(Response):
    """One request streamed as server-sent events, each sent once the generation path yields its
    message; the next is taken only once uvicorn has written this one. A disconnect cancels it."""

    def __init__(self, api, identity, req: pb.GenerateRequest, options: dict, encoder: Encoder) -> None:
        super().__init__(status_code=200)
        self.api, self.identity, self.req, self.options, self.encoder = api, identity, req, options, encoder

    async def __call__(self, scope, receive, send) -> None:
        from gateway.http_api import _START, _HttpStreamContext, _peer, _wait_disconnect

        task = asyncio.current_task()
        state = {"done": False, "disconnected": False}

        async def watch() -> None:
            await _wait_disconnect(receive)
            if not state["done"]:
                state["disconnected"] = True
                task.cancel()

        async def body(chunks: list[bytes]) -> None:
            if chunks:
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})

        control = StreamControl(task, _HttpStreamContext(), log_id="")
        gen = self.api.service.run(
            self.req, self.identity, control=control, client=_peer(scope), **self.options
        )
        watcher = asyncio.ensure_future(watch())
        started = False
        try:
            try:
                async for msg in gen:
                    if not started:
                        await send(_START)
                        started = True
                        await body(self.encoder.start())
                    await body(self.encoder.message(msg))
            except RequestError as e:
                if not started:  # refused before any output: a plain error response
                    state["done"] = True
                    await self.encoder.refusal(e)(scope, receive, send)
                    return
                await body([self.encoder.error(e)])
                state["done"] = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            finally:
                await gen.aclose()
            if not started:
                await send(_START)
                await body(self.encoder.start())
            state["done"] = True
            await send(
                {"type": "http.response.body", "body": b"".join(self.encoder.end()), "more_body": False}
            )
        except asyncio.CancelledError:
            if state["disconnected"] or control.stalled:
                return  # the connection is gone or is being dropped; the engine request was aborted
            raise
        finally:
            state["done"] = True
            watcher.cancel()
