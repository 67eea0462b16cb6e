"""llmserve.v1.Embeddings: each input becomes one engine request on the one generation path
(``GenerationService.run``: validation, admission, the tenant's cache salt, metrics, logging,
cancel) that runs only its prompt and returns its pooled vector (engine_svc/pooling.py). The
inputs of a call run concurrently, so they share engine steps; each vector is the same, bit for
bit on CPU, as that input's alone. The HTTP front ends (/v1/embeddings, Ollama's /api/embed) call
``embed`` with their own field names.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import numpy as np

from gateway.auth import Identity
from gateway.embed_sink import EmbedSink
from gateway.errors import FieldViolation, RequestError, invalid, refuse, unavailable
from gateway.gateway_state import GatewayState
from gateway.generation_service import GenerationService
from llmserve_proto.llmserve.v1 import embeddings_pb2 as pb
from llmserve_proto.llmserve.v1 import embeddings_pb2_grpc as pb_grpc
from llmserve_proto.llmserve.v1 import generation_pb2 as gen_pb

MAX_EMBED_INPUTS = 2048  # inputs in one call (OpenAI's limit); each is one engine request


class EmbeddingService(pb_grpc.EmbeddingsServicer):
    def __init__(self, state: GatewayState, generation: GenerationService) -> None:
        self.s = state
        self.generation = generation

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        try:
            sinks = await self.embed(
                request, self.s.auth.identity_of(context), context.time_remaining, client=context.peer()
            )
        except RequestError as e:
            refuse(context, e)
            return pb.EmbedResponse()
        tokens = sum(x.prompt_tokens for x in sinks)
        out = pb.EmbedResponse(request_id=request.request_id, prompt_tokens=tokens)
        for i, sink in enumerate(sinks):
            out.embeddings.add(index=i, values=vector(sink).tolist(), prompt_tokens=sink.prompt_tokens)
        return out

    async def embed(
        self,
        request: pb.EmbedRequest,
        identity: Identity,
        time_remaining: Callable[[], float | None] = lambda: None,
        client: str | None = None,
        field: str = "inputs",
    ) -> list[EmbedSink]:
        """The vectors of ``request.inputs``, in order; a refusal is raised as a RequestError whose
        violations name ``field[i]`` (the front end's name for the inputs)."""
        count = len(request.inputs)
        if not 1 <= count <= MAX_EMBED_INPUTS:
            raise invalid([FieldViolation(field, f"must hold 1 to {MAX_EMBED_INPUTS} inputs, got {count}")])
        bad = []
        for i, item in enumerate(request.inputs):
            kind = item.WhichOneof("input")
            empty = not item.text if kind == "text" else not item.token_ids.ids
            if kind is None or empty:
                bad.append(FieldViolation(f"{field}[{i}]", "must be a non-empty string or list of token ids"))
        if bad:
            raise invalid(bad)
        rid = request.request_id or uuid.uuid4().hex
        pooling = "mean" if request.pooling == pb.POOLING_MEAN else "last"
        normalize = request.normalize if request.HasField("normalize") else True
        sinks = [EmbedSink(pooling, normalize) for _ in request.inputs]
        # At most a quarter of the admission slots at once: a call of 2048 inputs goes in waves
        # (each wave shares engine steps) instead of overflowing the queue and being refused.
        wave = asyncio.Semaphore(max(1, self.s.limits.max_concurrent_requests // 4))

        async def one(i: int, item: pb.EmbedInput) -> None:
            async with wave:
                await run_one(i, item)

        async def run_one(i: int, item: pb.EmbedInput) -> None:
            g = gen_pb.GenerateRequest(
                request_id=f"{rid}-{i}" if count > 1 else rid,
                model=request.model,
                max_tokens=1,
                temperature=0.0,
                speculative=False,
            )
            if item.WhichOneof("input") == "text":
                g.text = item.text
            else:
                g.token_ids.ids.extend(item.token_ids.ids)
            try:
                run = self.generation.run(g, identity, time_remaining, client=client, embed=sinks[i])
                async for _ in run:
                    pass
            except RequestError as e:
                raise _renamed(e, f"{field}[{i}]") from None
            if not sinks[i].vector:  # the engine ended it without one (a drain, a lost engine)
                raise unavailable(f"{field}[{i}]: the request ended without its embedding")

        tasks = [asyncio.ensure_future(one(i, item)) for i, item in enumerate(request.inputs)]
        try:
            for t in asyncio.as_completed(tasks):
                await t  # the first refusal ends the call; the finally cancels the rest
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return sinks


def vector(sink: EmbedSink) -> np.ndarray:
    return np.frombuffer(sink.vector, dtype="<f4")


# The prompt fields the generation path names, as an embedding input is named by its front end.
_PROMPT_FIELDS = ("text", "token_ids.ids", "token_ids", "prompt")


def _renamed(e: RequestError, name: str) -> RequestError:
    violations = []
    for v in e.violations:
        field = v.field
        for prompt in _PROMPT_FIELDS:
            if field == prompt or field.startswith(prompt + "["):
                field = name + field[len(prompt) :]
                break
        violations.append(FieldViolation(field, v.description))
    if not violations:
        return e
    summary = "; ".join(f"{v.field}: {v.description}" for v in violations)
    return RequestError(e.code, f"invalid request: {summary}", violations, e.retry_after_s)
