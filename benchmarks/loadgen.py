"""A load generator for the service: many concurrent streams, per-token timings, and their summary.

Used by the benchmarks (serving, transports, tokenizer workers). Each stream records when each
token arrived; from those come TTFT, TPOT and the inter-token latencies (ITL).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

import grpc

from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc


@dataclass
class RequestRecord:
    start: float
    token_times: list[float] = field(default_factory=list)  # one entry per token received
    end: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None and r.token_times]
    itls = [x for r in ok for x in r.itls]
    tokens = sum(len(r.token_times) for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": round(wall_s, 3),
        "request_throughput": len(ok) / wall_s,
        "output_tok_s": tokens / wall_s,
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1e3 * percentile([r.ttft for r in ok], 99),
        "tpot_mean_ms": 1e3 * statistics.fmean(tpots) if tpots else float("nan"),
        "itl_p50_ms": 1e3 * percentile(itls, 50),
        "itl_p99_ms": 1e3 * percentile(itls, 99),
    }


async def stream_one(stub, request: gen.GenerateRequest, timeout: float = 600.0) -> RequestRecord:
    rec = RequestRecord(start=time.perf_counter())
    try:
        async for msg in stub.GenerateStream(request, timeout=timeout):
            now = time.perf_counter()
            rec.token_times += [now] * max(1, len(msg.token_ids)) if msg.token_ids or msg.text else []
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    rec.end = time.perf_counter()
    return rec


async def run_load(target: str, requests: list[gen.GenerateRequest], concurrency: int) -> tuple[list, float]:
    """Send ``requests`` keeping ``concurrency`` in flight; return the records and the wall time."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gen_grpc.GenerationStub(channel)
        queue = list(reversed(requests))
        records: list[RequestRecord] = []

        async def worker() -> None:
            while queue:
                records.append(await stream_one(stub, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - start
