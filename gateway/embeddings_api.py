"""OpenAI's ``POST /v1/embeddings``: JSON onto ``EmbeddingService.embed`` (the one generation path,
one engine request per input) and the vectors back in OpenAI's shape.

``input``: a string, a list of strings, a list of token ids, or a list of token-id lists.
``encoding_format``: "float" (default) or "base64" (the float32 little-endian bytes, as OpenAI
sends them). ``dimensions``: only the model's own size (its hidden size): a decoder's hidden state
cannot be shortened. ``user`` is accepted and unused. Extensions (vLLM's spelling where it has one):
``normalize`` (default true) and ``pooling`` ("last", the default, or "mean").
"""

from __future__ import annotations

import base64

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import Identity
from gateway.embedding_service import EmbeddingService, vector
from gateway.errors import FieldViolation, invalid
from gateway.openai_protocol import BodyReader
from gateway.streamed_response import peer
from llmserve_proto.llmserve.v1 import embeddings_pb2 as pb

FIELDS = {"input", "model", "encoding_format", "dimensions", "user", "normalize", "pooling", "request_id"}
POOLING = {"last": pb.POOLING_LAST, "mean": pb.POOLING_MEAN}


def embed_inputs(value, field: str, out: pb.EmbedRequest) -> None:
    """``value`` (a string, a list of strings, token ids, or token-id lists) into ``out.inputs``;
    a bad shape raises a violation naming ``field`` (and the element)."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        why = "is required: a string, a list of strings, token ids, or lists of token ids"
        raise invalid([FieldViolation(field, why)])
    bad = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.inputs.add(text=item)
        elif isinstance(item, list) and all(_is_int(t) and -(2**31) <= t < 2**31 for t in item):
            out.inputs.add().token_ids.ids.extend(item)
        else:
            bad.append(FieldViolation(f"{field}[{i}]", "must be a string or a list of token ids"))
    if bad:
        raise invalid(bad)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_dimensions(dimensions: int | None, size: int, field: str = "dimensions") -> None:
    if dimensions is not None and dimensions != size:
        raise invalid(
            [
                FieldViolation(
                    field,
                    f"is {dimensions}; this model's embeddings have {size} dimensions and cannot be "
                    "shortened (not supported: a decoder's hidden state is not a Matryoshka embedding)",
                )
            ]
        )


def routes(api) -> list[Route]:
    """The route, registered by ``gateway.http_api.HttpApi`` (its auth, body and error handling)."""
    service = EmbeddingService(api.s, api.service)

    async def handler(request: Request, identity: Identity, body) -> Response:
        r = BodyReader(body, FIELDS, "embeddings")
        req = pb.EmbedRequest(model=r.str("model") or "", request_id=r.str("request_id") or "")
        fmt = r.str("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            r.bad("encoding_format", f"must be 'float' or 'base64', got {fmt[:32]!r}")
        dimensions = r.int("dimensions", minimum=1)
        r.str("user")
        normalize = r.bool("normalize")
        if normalize is not None:
            req.normalize = normalize
        pooling = r.str("pooling") or "last"
        if pooling not in POOLING:
            r.bad("pooling", f"must be 'last' or 'mean', got {pooling[:32]!r}")
        r.done()
        req.pooling = POOLING[pooling]
        embed_inputs(body.get("input"), "input", req)
        api.s.check_serving()
        api.s.check_model(req.model)
        sinks = await service.embed(req, identity, client=peer(request.scope), field="input")
        data = []
        for i, sink in enumerate(sinks):
            vec = vector(sink)
            check_dimensions(dimensions, len(vec))
            value = base64.b64encode(sink.vector).decode() if fmt == "base64" else vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(s.prompt_tokens for s in sinks)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": api.s.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def embeddings(request: Request) -> Response:
        return await api._guarded(request, handler)

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]
