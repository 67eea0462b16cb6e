"""The load clients both serving benchmarks use (``serving.py`` for our service alone,
``peer.py`` against vLLM): gRPC request lists, an OpenAI streaming client over a raw socket, and the
mean of a figure over passes. A module of its own so that neither benchmark imports the other."""

from __future__ import annotations

import asyncio
import json
import time

from llmserve_proto.llmserve.v1 import generation_pb2 as gen


def grpc_requests(prompts: list[list[int]], output_len: int) -> list[gen.GenerateRequest]:
    return [
        gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=p),
            max_tokens=output_len,
            ignore_eos=True,
            temperature=0.0,
            return_token_ids=True,
        )
        for p in prompts
    ]


async def _read_chunked_lines(reader: asyncio.StreamReader):
    """Lines of an HTTP/1.1 chunked body (SSE), as they arrive."""
    buf = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            break
        size = int(size_line.strip().split(b";")[0] or b"0", 16)
        if size == 0:
            break
        buf += await reader.readexactly(size)
        await reader.readexactly(2)
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line


async def openai_stream_one(host: str, port: int, model: str, prompt: list[int], max_tokens: int):
    from benchmarks.loadgen import RequestRecord

    body = json.dumps(
        dict(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            stream=True,
            return_token_ids=True,
        )
    ).encode()
    rec = RequestRecord(start=time.perf_counter())
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body
        )
        await writer.drain()
        status = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if b" 200 " not in status:
            rec.error = status.decode().strip() + " " + (await reader.read(2000)).decode(errors="replace")
            return rec
        lines = (
            _read_chunked_lines(reader)
            if "chunked" in headers.get("transfer-encoding", "")
            else _plain_lines(reader)
        )
        async for line in lines:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[6:]).get("choices", []):
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                rec.token_times += [now] * n
        rec.end = time.perf_counter()
        if not rec.token_times:
            rec.error = "no tokens streamed"
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        rec.error = repr(e)
    finally:
        writer.close()
    return rec


async def _plain_lines(reader: asyncio.StreamReader):
    while line := await reader.readline():
        yield line


async def openai_load(host, port, model, prompts, output_lens, concurrency) -> tuple[list, float]:
    queue = list(reversed(list(zip(prompts, output_lens, strict=True))))
    records = []

    async def worker():
        while queue:
            p, n = queue.pop()
            records.append(await openai_stream_one(host, port, model, p, n))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def mean_summary(runs: list[dict]) -> dict:
    """Each figure's mean over the passes (counts summed)."""
    out = {}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        out[k] = sum(vals) if k in ("requests", "errors") else sum(vals) / len(vals)
    return out
