"""Prompt encoding for the gateway: in tokenizer worker processes, or inline when there are none.

Encoding a 32k-character prompt takes milliseconds of CPU; on the event loop that would stall
every stream the gateway is serving, so by default it happens in the TokenizerPool's workers.
Detokenization stays in the gateway: it is a few tokens per step and must keep per-sequence state.
"""

from __future__ import annotations

from pathlib import Path

from tokenizer_svc.tokenizer import Tokenizer


class Tokenization:
    def __init__(self, model_dir: str | Path, tokenizer: Tokenizer, num_workers: int) -> None:
        self._model_dir = str(model_dir)
        self._tokenizer = tokenizer
        self.num_workers = num_workers
        self._pool = None

    async def start(self) -> None:
        if self.num_workers > 0:
            from tokenizer_svc.pool import TokenizerPool

            self._pool = TokenizerPool(self._model_dir, self.num_workers)
            await self._pool.start()

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._pool is not None:
            return list(await self._pool.encode(text, add_special_tokens=add_special_tokens))
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        if self._pool is not None:
            return list(
                await self._pool.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            )
        return self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
