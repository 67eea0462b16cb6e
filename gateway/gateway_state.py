"""What every gateway handler shares: the engine link, the tokenizer, limits, and the requests in flight."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from gateway.admission import Admission
from gateway.auth import Authenticator
from gateway.engine_client import EngineClient, RequestHandle
from gateway.errors import RequestError, invalid, unavailable
from gateway.input_bounds import check_model_name
from gateway.limits import Limits
from gateway.metrics import GatewayMetrics
from gateway.model_digest import ModelDigest
from gateway.prompt_log import PromptLogPolicy
from gateway.quoting import quote
from gateway.stall_sweep import StreamControl
from gateway.supersede import SupersedeKeys
from gateway.tool_request import ToolOptions
from tokenizer_svc.pool import TokenizerPool
from tokenizer_svc.tokenizer import Tokenizer


class ServerAborting(Exception):
    """Put into a request's delta queue when the drain's grace period is over."""


@dataclass
class GatewayState:
    model_name: str
    # Both None in token-only mode (--skip-tokenizer-init): prompts and outputs are token ids.
    tokenizer: Tokenizer | None
    tokenization: TokenizerPool | None  # prompt encoding in worker processes (0 workers: on the loop)
    engine: EngineClient
    limits: Limits
    admission: Admission
    auth: Authenticator = field(default_factory=lambda: Authenticator(None))
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    prompt_log: PromptLogPolicy = field(default_factory=PromptLogPolicy)
    tool_options: ToolOptions = field(default_factory=ToolOptions)  # --tool-call-parser and friends
    # The served model's fill-in-the-middle format, or why it has none (gateway/infill.py).
    fim: object = None
    # The served model's digest (gateway/model_digest.py), worked out once in the background.
    model_digest: ModelDigest | None = None
    draining: bool = False
    inflight: dict[str, RequestHandle | None] = field(default_factory=dict)  # None while tokenizing
    streams: dict[str, StreamControl] = field(default_factory=dict)  # GenerateStream calls in flight
    supersede: SupersedeKeys = field(default_factory=SupersedeKeys)  # supersede_key -> its request
    _background: set[asyncio.Task] = field(default_factory=set)

    @property
    def token_only(self) -> bool:
        return self.tokenizer is None

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.engine.info.eos_token_ids)

    def check_serving(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down")
        if not self.engine.ready:
            raise unavailable("the engine is not available (starting, restarting or gone)")

    def lora_for_model(self, name: str) -> str:
        """The LoRA adapter an OpenAI ``model`` names: any name but the served model's, when the
        engine serves adapters ("" otherwise: ``check_model`` then refuses an unknown name)."""
        info = self.engine.info
        if not name or name == self.model_name or info is None or not info.max_loras:
            return ""
        return name

    def check_model(self, name: str) -> None:
        if not name or name == self.model_name:
            return
        too_long = check_model_name(name, self.limits)
        if too_long:
            raise invalid(too_long)
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"model {quote(name)} is not served here; this server has {self.model_name!r}",
        )

    def in_background(self, coro) -> None:
        """Run a coroutine that must finish even if the handler that started it is cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort_all(self) -> None:
        for handle in self.inflight.values():
            if handle is not None:
                handle._put(ServerAborting())
