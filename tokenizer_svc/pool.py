"""Tokenize off the event loop: a pool of tokenizer worker processes behind async methods.

A 32k-character prompt takes milliseconds to encode, and a chat template more; done on the
gateway's event loop, that time is taken from every stream it is serving. The pool sends each
request to the least-loaded worker process (protobuf frames over pipes) and awaits the answer.
``num_workers=0`` runs the tokenizer in-process instead, on the loop (offline use, and the
baseline the benchmark compares against).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from llmserve_proto.tokenizer.v1 import tokenizer_pb2 as pb
from tokenizer_svc.chat_messages import to_proto, validate_tools
from tokenizer_svc.piece_cache import MIN_CHARS
from tokenizer_svc.tokenizer import Tokenizer, load_tokenizer, validate_messages
from tokenizer_svc.worker_process import TokenizerWorkerDied, TokenizerWorkerError, WorkerProcess

__all__ = ["TokenizerPool", "TokenizerWorkerDied", "TokenizerWorkerError"]

# A worker that dies again this many times in a row without answering anything is not restarted.
_MAX_RESTARTS_IN_A_ROW = 3
_MAX_TOKEN_ID = 2**32 - 1
_AFFINITY_KEYS = 4096  # system messages remembered, least recently used out first


def _session_key(messages: list[dict]) -> int | None:
    """A chat's first message if it is long enough to be kept by a worker's piece cache, hashed:
    requests of one session (and sessions of one system prompt) share it."""
    first = messages[0].get("content") if messages and isinstance(messages[0], dict) else None
    return hash(first) if isinstance(first, str) and len(first) >= MIN_CHARS else None


class TokenizerPool:
    def __init__(
        self, model_dir: str | Path, num_workers: int = 1, chat_template: str | Path | None = None
    ) -> None:
        if num_workers < 0:
            raise ValueError("num_workers must be >= 0")
        self.model_dir = Path(model_dir)
        self.chat_template = chat_template  # a Jinja file replacing the model's (--chat-template)
        self.num_workers = num_workers
        self._local: Tokenizer | None = None
        self._workers: list[WorkerProcess] = []
        self._restarts: dict[int, asyncio.Task] = {}
        self._failed_restarts = [0] * num_workers
        self._next = 0  # round-robin start among equally loaded workers
        # A chat's system message -> the worker that last encoded it: a session's turns go back to
        # the worker whose piece cache holds its long system prompt (piece_cache.py), unless that
        # worker is busier than another.
        self._affinity: OrderedDict[int, int] = OrderedDict()
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.alive]

    async def start(self) -> None:
        if self.num_workers == 0:
            self._local = load_tokenizer(self.model_dir, self.chat_template)
            return
        started = await asyncio.gather(
            *(self._start_worker(i) for i in range(self.num_workers)),
            return_exceptions=True,
        )
        self._workers = [w for w in started if isinstance(w, WorkerProcess)]
        errors = [e for e in started if isinstance(e, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    async def encode(
        self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool = False
    ) -> list[int]:
        """Client text: a special token's string in it is plain text unless ``parse_special_tokens``."""
        if self._local is not None:
            return self._local.encode(
                text, add_special_tokens=add_special_tokens, parse_special_tokens=parse_special_tokens
            )
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        encode = pb.EncodeRequest(
            text=text, add_special_tokens=add_special_tokens, parse_special_tokens=parse_special_tokens
        )
        request = pb.WorkerRequest(encode=encode)
        return list((await self._call(request)).token_ids.ids)

    def _start_worker(self, index: int):
        return WorkerProcess.start(self.model_dir, index, self._on_death, chat_template=self.chat_template)

    async def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        if self._local is not None:
            return self._local.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                enable_thinking=enable_thinking,
            )
        validate_messages(messages)
        validate_tools(tools)
        pb_messages, pb_tools = to_proto(messages, tools)
        chat = pb.ChatRequest(
            messages=pb_messages,
            tools=pb_tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
        return list((await self._call(pb.WorkerRequest(chat=chat), _session_key(messages))).token_ids.ids)

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._local is not None:
            return self._local.decode(ids, skip_special_tokens=skip_special_tokens)
        ids = list(ids)
        if not all(isinstance(i, int) and 0 <= i <= _MAX_TOKEN_ID for i in ids):
            raise ValueError("token ids must be integers in [0, 2**32)")
        decode = pb.DecodeRequest(token_ids=ids, skip_special_tokens=skip_special_tokens)
        return (await self._call(pb.WorkerRequest(decode=decode))).text

    async def close(self) -> None:
        """Stop every worker and wait for it to exit; no child process outlives this."""
        self._closed = True
        for task in self._restarts.values():
            task.cancel()
        await asyncio.gather(*self._restarts.values(), return_exceptions=True)
        self._restarts.clear()
        await asyncio.gather(*(w.stop() for w in self._workers))

    async def __aenter__(self) -> TokenizerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, request: pb.WorkerRequest, key: int | None = None) -> pb.WorkerResponse:
        worker = await self._pick(key)
        response = await worker.call(request)
        self._failed_restarts[worker.index] = 0
        if response.WhichOneof("result") == "error":
            if response.error.kind == pb.WorkerError.INVALID_ARGUMENT:
                raise ValueError(response.error.message)
            raise TokenizerWorkerError(f"tokenizer worker {worker.index}: {response.error.message}")
        return response

    async def _pick(self, key: int | None = None) -> WorkerProcess:
        if self._closed:
            raise RuntimeError("the tokenizer pool is closed")
        if not self._workers:
            raise RuntimeError("the tokenizer pool is not started")
        while True:
            n = len(self._workers)
            live = [self._workers[(self._next + k) % n] for k in range(n)]
            live = [w for w in live if w.alive]
            if live:
                self._next = (self._next + 1) % n
                least = min(live, key=lambda w: len(w.pending))  # min keeps the first of equals
                if key is None:
                    return least
                index = self._affinity.pop(key, None)
                worker = next((w for w in live if w.index == index), None)
                if worker is None or len(worker.pending) > len(least.pending):
                    worker = least
                self._affinity[key] = worker.index
                if len(self._affinity) > _AFFINITY_KEYS:
                    self._affinity.popitem(last=False)
                return worker
            if not self._restarts:
                raise TokenizerWorkerDied("every tokenizer worker has died and none could be restarted")
            await asyncio.wait(list(self._restarts.values()), return_when=asyncio.FIRST_COMPLETED)

    def _on_death(self, worker: WorkerProcess) -> None:
        if self._closed or worker.index in self._restarts:
            return
        self._failed_restarts[worker.index] += 1
        if self._failed_restarts[worker.index] > _MAX_RESTARTS_IN_A_ROW:
            return
        self._restarts[worker.index] = asyncio.create_task(self._restart(worker.index))

    async def _restart(self, index: int) -> None:
        try:
            self._workers[index] = await self._start_worker(index)
        except Exception:
            pass  # the dead worker stays in its slot, not alive, so no request is sent to it
        finally:
            self._restarts.pop(index, None)
