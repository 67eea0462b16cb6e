"""llmserve.v1.Router: what an external KV-aware router polls and subscribes to.

``GetLoad`` asks every engine for its current figures (the heartbeats' copy can be seconds old
while an engine is busy: it sends heartbeats only when quiet). ``StreamKvEvents`` relays each
engine's KV-event stream, tagged with its replica index. Relaying keeps the back-pressure honest: a
subscriber that reads slowly stops this relay's reads, the engine's bounded buffer for it fills,
and the engine drops it (RESOURCE_EXHAUSTED, passed on) without ever waiting for it.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from gateway.errors import RequestError, refuse, unavailable
from gateway.gateway_state import GatewayState
from llmserve_proto.llmserve.v1 import router_pb2 as pb
from llmserve_proto.llmserve.v1 import router_pb2_grpc as pb_grpc

log = logging.getLogger("gateway.router")
STATS_TIMEOUT_S = 5.0


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, state: GatewayState) -> None:
        self.s = state

    def _engines(self) -> list:
        engine = self.s.engine
        return list(getattr(engine, "replicas", [engine]))  # a ReplicaSet, or one EngineClient

    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.LoadReport:
        engines = self._engines()
        loads = await asyncio.gather(*(self._load_of(i, e) for i, e in enumerate(engines)))
        report = pb.LoadReport(replicas=loads)
        total, ready = report.total, [r for r in loads if r.ready]
        total.ready = bool(ready)
        for r in ready:
            for f in (
                "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "prefix_queried_tokens",
                "prefix_hit_tokens", "prompt_tokens_per_s", "generation_tokens_per_s",
            ):  # fmt: skip
                setattr(total, f, getattr(total, f) + getattr(r, f))
        total.block_size = ready[0].block_size if ready else 0
        _fractions(total)
        return report

    async def _load_of(self, index: int, engine) -> pb.ReplicaLoad:
        out = pb.ReplicaLoad(replica=index, address=engine.address, ready=engine.ready)
        if not engine.ready:
            return out
        try:
            load = (await asyncio.wait_for(engine.stats(), STATS_TIMEOUT_S)).load
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            log.warning("load of replica %d (%s): %s; using its last heartbeat", index, engine.address, e)
            load = engine.load
        out.num_running, out.num_waiting = load.num_running, load.num_waiting
        out.kv_blocks_used, out.kv_blocks_total = load.kv_blocks_used, load.kv_blocks_total
        out.prefix_queried_tokens, out.prefix_hit_tokens = load.prefix_queried_tokens, load.prefix_hit_tokens
        out.prompt_tokens_per_s = load.prompt_tokens_per_s
        out.generation_tokens_per_s = load.generation_tokens_per_s
        out.block_size = engine.info.block_size if engine.info else 0
        _fractions(out)
        return out

    async def StreamKvEvents(self, request: pb.StreamKvEventsRequest, context):
        engines = self._engines()
        if not all(e.ready for e in engines):
            down = [i for i, e in enumerate(engines) if not e.ready]
            refuse(context, unavailable(f"engine replica(s) {down} not connected; subscribe again later"))
            return
        queue: asyncio.Queue = asyncio.Queue(maxsize=4)  # small: a slow reader is felt by the engine
        pumps = [asyncio.ensure_future(_relay(i, e, queue)) for i, e in enumerate(engines)]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, RequestError):
                    log.info("KV-event subscriber ended: %s", item.message)
                    refuse(context, item)
                    return
                yield item
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)


async def _relay(index: int, engine, queue: asyncio.Queue) -> None:
    call = engine.kv_events()
    try:
        async for batch in call:
            # engine.v1's KvEventBatch and ours share their field numbers: the bytes are the same.
            out = pb.KvEventBatch.FromString(batch.SerializeToString())
            out.replica = index
            await queue.put(out)
        await queue.put(unavailable(f"engine replica {index} ended its KV-event stream"))
    except grpc.aio.AioRpcError as e:
        code = e.code() if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else grpc.StatusCode.UNAVAILABLE
        await queue.put(RequestError(code, f"engine replica {index}: {e.details()}"))
    finally:
        call.cancel()


def _fractions(load: pb.ReplicaLoad) -> None:
    load.kv_usage = load.kv_blocks_used / max(1, load.kv_blocks_total)
    load.prefix_hit_rate = load.prefix_hit_tokens / max(1, load.prefix_queried_tokens)
