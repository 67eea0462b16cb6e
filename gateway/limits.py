"""What the gateway enforces before a request reaches the engine (reported by GetModelInfo)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Each limit is answered with INVALID_ARGUMENT naming the field and the limit (admission with
    RESOURCE_EXHAUSTED), before the request is tokenized where that is possible."""

    max_concurrent_requests: int = 256  # requests submitted to the engine at once
    max_queue_length: int = 1024  # requests waiting for one of those slots; beyond: RESOURCE_EXHAUSTED
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_prompt_chars: int = 1 << 20  # checked before tokenizing, so a huge text never reaches a worker
    max_stop_token_ids: int = 64
    max_request_id_chars: int = 256
    default_max_tokens: int = 16
    max_prompt_tokens: int = 0  # 0: the model's context minus one
    max_tokens: int = 0  # the most new tokens a request may ask for; 0: the model's context minus one
    max_message_bytes: int = 16 << 20  # a gRPC message, either way; a larger request is refused by gRPC

    def prompt_token_limit(self, max_model_len: int) -> int:
        cap = max_model_len - 1
        return min(self.max_prompt_tokens, cap) if self.max_prompt_tokens > 0 else cap

    def max_tokens_limit(self, max_model_len: int) -> int:
        cap = max_model_len - 1
        return min(self.max_tokens, cap) if self.max_tokens > 0 else cap
