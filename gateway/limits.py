"""What the gateway enforces before a request reaches the engine (reported by GetModelInfo)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
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
