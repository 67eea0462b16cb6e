"""A small Python client for llmserve (generated stubs underneath; any other language can do the same).

from gateway.client import LLMServeClient

with LLMServeClient("127.0.0.1:50051") as client:
    for msg in client.generate_stream("Once upon a time", max_tokens=32, temperature=0.0):
        print(msg.text, end="", flush=True)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_svc.rpc.defaults import GATEWAY_PORT
from engine_svc.rpc.grpc_options import Keepalive
from engine_svc.rpc.tls import ClientTLS
from llmserve_proto.llmserve.v1 import (
    adapters_pb2,
    adapters_pb2_grpc,
    embeddings_pb2,
    embeddings_pb2_grpc,
    models_pb2,
    models_pb2_grpc,
)
from llmserve_proto.llmserve.v1 import generation_pb2 as gen
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as gen_grpc

Message = dict | tuple[str, str]


def finish_name(reason: int) -> str:
    """ "stop", "length", "abort" for a llmserve.v1 FinishReason ("?" for one this build lacks)."""
    try:
        return gen.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return "?"


def _tools_onto(chat: gen.Chat, tools, tool_choice) -> None:
    """``tools`` in OpenAI's shape (``{"type": "function", "function": {"name", "description",
    "parameters"}}``); ``tool_choice`` "auto" / "none" / "required" or a function's name."""
    import json

    for t in tools or []:
        fn = t["function"]
        params = fn.get("parameters")
        chat.tools.add(
            name=fn["name"],
            description=fn.get("description", ""),
            parameters=json.dumps(params) if params else "",
        )
    modes = {
        "auto": gen.ToolChoice.MODE_AUTO,
        "none": gen.ToolChoice.MODE_NONE,
        "required": gen.ToolChoice.MODE_REQUIRED,
    }
    if tool_choice in modes:
        chat.tool_choice.mode = modes[tool_choice]
    elif tool_choice is not None:
        chat.tool_choice.function = tool_choice


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Iterable[int] | None = None,
    messages: Iterable[Message] | None = None,
    **options,
) -> gen.GenerateRequest:
    """A GenerateRequest from one of ``prompt`` / ``token_ids`` / ``messages`` and keyword options
    named like the proto fields (temperature=0.0, max_tokens=32, stop=["\\n"], n=2, ...)."""
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids or messages")
    req = gen.GenerateRequest()
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        add_gen = options.pop("add_generation_prompt", None)
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
            req.chat.messages.add(role=role, content=content)
        if add_gen is not None:
            req.chat.add_generation_prompt = add_gen
        _tools_onto(req.chat, options.pop("tools", None), options.pop("tool_choice", None))
    for name, value in options.items():
        if value is None:
            continue
        if name not in gen.GenerateRequest.DESCRIPTOR.fields_by_name:
            raise TypeError(f"unknown GenerateRequest option {name!r}")
        field = getattr(req, name)
        if isinstance(value, (list, tuple)) and hasattr(field, "extend"):
            field.extend(value)
        elif isinstance(value, dict) and hasattr(field, "update"):  # a map field (logit_bias)
            field.update(value)
        elif hasattr(field, "CopyFrom"):  # a message field (choice=gen.Choices(...))
            field.CopyFrom(value)
        else:
            setattr(req, name, value)
    return req


class LLMServeClient:
    def __init__(
        self,
        target: str = f"127.0.0.1:{GATEWAY_PORT}",
        timeout: float | None = None,
        channel: grpc.Channel | None = None,
        api_key: str | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        """``api_key`` is sent as ``authorization: Bearer ...`` on every call (health too, harmlessly);
        ``tls`` makes the channel a TLS one (with a client certificate for mTLS)."""
        self.target = target
        self.timeout = timeout
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        options = [
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.max_send_message_length", 16 << 20),
            *Keepalive().client_options(),
        ]
        if channel is None and tls is not None:
            channel = grpc.secure_channel(target, tls.credentials(), options=options + tls.channel_options())
        self.channel = channel or grpc.insecure_channel(target, options=options)
        self.generation = gen_grpc.GenerationStub(self.channel)
        self.models = models_pb2_grpc.ModelsStub(self.channel)
        self.adapters = adapters_pb2_grpc.AdaptersStub(self.channel)
        self.embeddings = embeddings_pb2_grpc.EmbeddingsStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> LLMServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
    ) -> Iterator[gen.GenerateResponse]:
        """Stream messages as they come (one per piece of new output of any of the n sequences)."""
        return self.generation.GenerateStream(
            build_request(prompt, **kwargs), timeout=timeout or self.timeout, metadata=self.metadata
        )

    def load_adapter(self, name: str, path: str) -> adapters_pb2.Adapter:
        """Load (or reload) a LoRA adapter from a PEFT directory on the engine's host."""
        request = adapters_pb2.LoadAdapterRequest(name=name, path=str(path))
        return self.adapters.LoadAdapter(request, timeout=self.timeout, metadata=self.metadata)

    def unload_adapter(self, name: str) -> None:
        request = adapters_pb2.UnloadAdapterRequest(name=name)
        self.adapters.UnloadAdapter(request, timeout=self.timeout, metadata=self.metadata)

    def list_adapters(self) -> adapters_pb2.ListAdaptersResponse:
        request = adapters_pb2.ListAdaptersRequest()
        return self.adapters.ListAdapters(request, timeout=self.timeout, metadata=self.metadata)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
    ) -> gen.GenerateResponse:
        """The whole result at once (n > 1: sequences 1.. are in ``additional_sequences``)."""
        return self.generation.Generate(
            build_request(prompt, **kwargs), timeout=timeout or self.timeout, metadata=self.metadata
        )

    def embed(
        self, inputs: Iterable[str | list[int]], *, pooling: str = "last", normalize: bool = True
    ) -> list[list[float]]:
        """One vector per input (a text, or a list of token ids), in order."""
        req = embeddings_pb2.EmbedRequest(
            pooling=embeddings_pb2.POOLING_MEAN if pooling == "mean" else embeddings_pb2.POOLING_LAST,
            normalize=normalize,
        )
        for item in inputs:
            if isinstance(item, str):
                req.inputs.add(text=item)
            else:
                req.inputs.add().token_ids.ids.extend(item)
        out = self.embeddings.Embed(req, timeout=self.timeout, metadata=self.metadata)
        return [list(e.values) for e in out.embeddings]

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[Message] | None = None,
        add_special_tokens: bool | None = None,
    ) -> list[int]:
        req = gen.TokenizeRequest()
        if messages is not None:
            for m in messages:
                role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
                req.chat.messages.add(role=role, content=content)
        else:
            req.text = text
        if add_special_tokens is not None:
            req.add_special_tokens = add_special_tokens
        return list(self.generation.Tokenize(req, timeout=self.timeout, metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        req = gen.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.generation.Detokenize(req, timeout=self.timeout, metadata=self.metadata).text

    def list_models(self) -> models_pb2.ListModelsResponse:
        return self.models.ListModels(
            models_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self.metadata
        )

    def model_info(self, model: str = "") -> models_pb2.ModelInfo:
        return self.models.GetModelInfo(
            models_pb2.GetModelInfoRequest(model=model), timeout=self.timeout, metadata=self.metadata
        )

    def health_status(self, service: str = "") -> int:
        """health_pb2.HealthCheckResponse.SERVING, NOT_SERVING, ..."""
        return self.health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 5
        ).status

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health_status() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target} was not SERVING within {timeout:.0f}s")
            time.sleep(0.1)
