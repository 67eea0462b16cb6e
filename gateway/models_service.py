"""llmserve.v1.Models: the served model, its facts, and the limits this gateway enforces."""

from __future__ import annotations

from gateway.errors import RequestError, refuse, unavailable
from gateway.gateway_state import GatewayState
from llmserve_proto.llmserve.v1 import models_pb2 as pb
from llmserve_proto.llmserve.v1 import models_pb2_grpc as pb_grpc


class ModelsService(pb_grpc.ModelsServicer):
    def __init__(self, state: GatewayState) -> None:
        self.s = state

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        try:
            return pb.ListModelsResponse(models=[self._info()], default_model=self.s.model_name)
        except RequestError as e:
            refuse(context, e)
            return pb.ListModelsResponse()

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        try:
            self.s.check_model(request.model)
            return self._info()
        except RequestError as e:
            refuse(context, e)
            return pb.ModelInfo()

    def _info(self) -> pb.ModelInfo:
        info, lim = self.s.engine.info, self.s.limits
        if info is None:
            raise unavailable("the engine has not connected yet")
        return pb.ModelInfo(
            name=self.s.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            has_chat_template=not self.s.token_only and self.s.tokenizer.has_chat_template,
            limits=pb.ServerLimits(
                max_concurrent_requests=lim.max_concurrent_requests,
                max_queue_length=lim.max_queue_length,
                max_n=lim.max_n,
                max_logprobs=min(lim.max_logprobs, info.max_logprobs),
                max_stop_strings=lim.max_stop_strings,
                max_stop_string_chars=lim.max_stop_string_chars,
                max_prompt_tokens=lim.prompt_token_limit(info.max_model_len),
                max_tokens=lim.max_tokens_limit(info.max_model_len),
                max_prompt_chars=lim.max_prompt_chars,
                max_prompt_bytes=lim.max_prompt_bytes,
                max_chat_messages=lim.max_chat_messages,
                max_role_bytes=lim.max_role_bytes,
                allowed_roles=list(lim.allowed_roles),
                max_model_name_bytes=lim.max_model_name_bytes,
                max_detokenize_ids=lim.max_detokenize_ids,
                max_request_id_chars=lim.max_request_id_chars,
                max_unsent_messages=lim.max_unsent_messages,
                max_unsent_bytes=lim.max_unsent_bytes,
                max_unsent_tokens=lim.max_unsent_tokens,
                stream_stall_timeout_s=lim.stream_stall_timeout_s,
                stream_pause_after_s=lim.stream_pause_after_s,
                max_paused_streams=lim.max_paused_streams,
                new_client_slots=lim.new_client_slot_count(),
            ),
        )
