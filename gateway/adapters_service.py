"""llmserve.v1.Adapters: LoRA adapters loaded and unloaded at run time, on every engine replica.
An admin API: behind the API keys like every other service (gateway/auth.py). The engine reads the
path on its own host and names any problem; its status codes pass through unchanged."""

from __future__ import annotations

import grpc

from gateway.engine_client import EngineUnavailable
from gateway.errors import FieldViolation, RequestError, invalid, refuse, unavailable
from gateway.gateway_state import GatewayState
from gateway.input_bounds import check_lora_name
from llmserve_proto.llmserve.v1 import adapters_pb2 as pb
from llmserve_proto.llmserve.v1 import adapters_pb2_grpc as pb_grpc

MAX_PATH_BYTES = 4096


class AdaptersService(pb_grpc.AdaptersServicer):
    def __init__(self, state: GatewayState) -> None:
        self.s = state

    async def LoadAdapter(self, request, context) -> pb.Adapter:
        try:
            bad = _check_name(request.name)
            if not request.path:
                bad.append(FieldViolation("path", "must not be empty"))
            elif len(request.path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
                bad.append(FieldViolation("path", f"is longer than {MAX_PATH_BYTES} bytes"))
            if bad:
                raise invalid(bad)
            info = await self._engine_call(self.s.engine.load_adapter(request.name, request.path))
            return _adapter(info)
        except RequestError as e:
            refuse(context, e)
            return pb.Adapter()

    async def UnloadAdapter(self, request, context) -> pb.UnloadAdapterResponse:
        try:
            bad = _check_name(request.name)
            if bad:
                raise invalid(bad)
            await self._engine_call(self.s.engine.unload_adapter(request.name))
            return pb.UnloadAdapterResponse()
        except RequestError as e:
            refuse(context, e)
            return pb.UnloadAdapterResponse()

    async def ListAdapters(self, request, context) -> pb.ListAdaptersResponse:
        try:
            got = await self._engine_call(self.s.engine.list_adapters())
            return pb.ListAdaptersResponse(
                adapters=[_adapter(a) for a in got.adapters],
                max_loras=got.max_loras,
                max_lora_rank=got.max_lora_rank,
            )
        except RequestError as e:
            refuse(context, e)
            return pb.ListAdaptersResponse()

    async def _engine_call(self, call):
        try:
            return await call
        except EngineUnavailable as e:
            raise unavailable(str(e)) from e
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid([FieldViolation("path", e.details())]) from e
            raise RequestError(e.code(), e.details()) from e


def _check_name(name: str) -> list[FieldViolation]:
    if not name:
        return [FieldViolation("name", "must not be empty")]
    return [FieldViolation("name", v.description) for v in check_lora_name(name)]


def _adapter(info) -> pb.Adapter:
    return pb.Adapter(
        name=info.name,
        path=info.path,
        rank=info.rank,
        version=info.version,
        target_modules=list(info.target_modules),
    )
