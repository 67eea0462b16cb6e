"""What the gateway enforces before a request reaches the engine (reported by GetModelInfo)."""

from __future__ import annotations

from dataclasses import dataclass

# The roles the common chat templates (ChatML, Llama 3, Mistral, Qwen) know; --chat-roles changes it.
DEFAULT_ROLES = ("system", "user", "assistant", "tool", "developer")


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
    # Every client string is bounded before any work is done on it (issue 17): a chat of millions
    # of empty messages, or an 8 MiB role, must cost a length check, not a tokenizer run.
    # UTF-8 bytes of a text prompt, or of all chat roles + contents: 1 MiB of characters of 2 bytes
    max_prompt_bytes: int = 2 << 20
    max_chat_messages: int = 2048
    max_role_bytes: int = 32
    allowed_roles: tuple[str, ...] = DEFAULT_ROLES
    max_model_name_bytes: int = 256
    max_detokenize_ids: int = 1 << 17
    # Backpressure (gateway/stream_buffer.py): output a client has not taken yet, per stream.
    max_unsent_messages: int = 64
    max_unsent_bytes: int = 256 << 10
    max_unsent_tokens: int = 64  # a message may carry several (drafts accepted in one step)
    stream_stall_timeout_s: float = 30.0
    # Slow readers (docs/slow-readers.md): output untaken this long pauses the request in the engine
    # (0: only the two bounds above pause); a paused stream holds no admission slot and no seat.
    stream_pause_after_s: float = 1.0
    # Streams paused at once; past it, the one unread longest is ended (RESOURCE_EXHAUSTED). 0: no bound
    max_paused_streams: int = 256
    # Of max_concurrent_requests, kept for clients (connections) that hold none; -1: an eighth
    new_client_slots: int = -1

    def new_client_slot_count(self) -> int:
        if self.new_client_slots < 0:
            return self.max_concurrent_requests // 8
        return min(self.new_client_slots, self.max_concurrent_requests)

    def prompt_token_limit(self, max_model_len: int) -> int:
        cap = max_model_len - 1
        return min(self.max_prompt_tokens, cap) if self.max_prompt_tokens > 0 else cap

    def max_tokens_limit(self, max_model_len: int) -> int:
        cap = max_model_len - 1
        return min(self.max_tokens, cap) if self.max_tokens > 0 else cap
