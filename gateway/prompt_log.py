"""What a request's log line may say about its prompt.

Prompts are other people's data: a request line says how long the prompt is, never what it says,
unless the operator asked for it with ``--log-prompts`` (debugging on a private deployment).
Generated text is never logged.
"""

from __future__ import annotations


class PromptLogPolicy:
    def __init__(self, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts

    def fields(
        self, *, text: str | None = None, chat: list[dict] | None = None, num_tokens: int | None = None
    ) -> dict:
        out: dict = {}
        if text is not None:
            out["prompt_chars"] = len(text)
        if chat is not None:
            out["chat_messages"] = len(chat)
            out["prompt_chars"] = sum(len(m.get("content", "")) for m in chat)
        if num_tokens is not None:
            out["prompt_tokens"] = num_tokens
        if self.log_prompts:
            if text is not None:
                out["prompt"] = text
            if chat is not None:
                out["chat"] = chat
        return out
