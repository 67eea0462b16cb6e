"""What the Anthropic Messages and OpenAI Responses adapters share: one request's run through the
generation path (``GenerationService.run``, as the chat completions route takes it), whole or as a
stream of server-sent events, and its output cut into the ordered blocks both APIs speak of
(reasoning, text, tool calls), so that a streamed reply and a whole one are built from the same
pieces. The stream itself is ``gateway.streamed_response.StreamedResponse`` with each API's encoder.

A client that leaves cancels the run (its engine request is aborted); a stream whose client stops
reading is held up by uvicorn's send and ended by the stall sweep, as chat completions' are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.streamed_response import peer, wait_disconnect
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
    out = Output()
    return out if await run_whole(api, request, identity, req, options, out.feed) else None


async def run_whole(api, request, identity, req: pb.GenerateRequest, options: dict, feed) -> bool:
    """Run one request to its end, each message to ``feed``; False when the client left first (the
    run is cancelled, and its generator aborts the engine request). A refusal or failure raises."""

    async def one() -> None:
        async for msg in api.service.run(req, identity, client=peer(request.scope), **options):
            feed(msg)

    task = asyncio.ensure_future(one())
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            return False
        task.result()  # a refusal or failure
        return True
    finally:
        watcher.cancel()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
