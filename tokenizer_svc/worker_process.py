"""One tokenizer worker as seen from the pool: its child process, its pipes, its requests in flight."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from llmserve_proto.tokenizer.v1 import tokenizer_pb2 as pb
from tokenizer_svc.framing import frame, read_frame_async

_REPO_ROOT = Path(__file__).resolve().parent.parent


class TokenizerWorkerError(RuntimeError):
    """A worker failed to answer a request for a reason other than the request being invalid."""


class TokenizerWorkerDied(TokenizerWorkerError):
    """The worker process exited (or could not start) while a request needed it."""


class WorkerProcess:
    def __init__(self, index: int, proc: asyncio.subprocess.Process) -> None:
        self.index = index
        self.proc = proc
        self.pending: dict[int, asyncio.Future[pb.WorkerResponse]] = {}
        self.death: str | None = None  # why the worker is gone, once it is
        self._ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._stopping = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.death is None

    @classmethod
    async def start(
        cls,
        model_dir: str | Path,
        index: int,
        on_death: Callable[[WorkerProcess], None],
        timeout: float = 120.0,
        chat_template: str | Path | None = None,
    ) -> WorkerProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        # One request at a time per worker; parallelism comes from the number of workers.
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        template = ["--chat-template", str(chat_template)] if chat_template is not None else []
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokenizer_svc.worker", "--model", str(model_dir), *template,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        worker = cls(index, proc)
        try:
            payload = await asyncio.wait_for(read_frame_async(proc.stdout), timeout)
        except BaseException:
            await worker._kill()
            raise
        if payload is None or pb.WorkerResponse.FromString(payload).WhichOneof("result") != "ready":
            code = await worker._kill()
            raise TokenizerWorkerDied(
                f"tokenizer worker {index} (pid {proc.pid}) exited with code {code} before it was "
                f"ready; its stderr says why"
            )
        worker._reader = asyncio.create_task(worker._read_responses(on_death))
        return worker

    async def call(self, request: pb.WorkerRequest) -> pb.WorkerResponse:
        if self.death is not None:
            raise TokenizerWorkerDied(self.death)
        request.request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[request.request_id] = future
        try:
            self.proc.stdin.write(frame(request.SerializeToString()))
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the reader sees the exit too and fails this future with the exit code
        try:
            return await future
        finally:
            self.pending.pop(request.request_id, None)

    async def stop(self, timeout: float = 5.0) -> None:
        """Close stdin so the worker exits by itself; kill it if it does not in time."""
        self._stopping = True
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                await self._kill()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read_responses(self, on_death: Callable[[WorkerProcess], None]) -> None:
        reason = "closed its output"
        try:
            while (payload := await read_frame_async(self.proc.stdout)) is not None:
                response = pb.WorkerResponse.FromString(payload)
                future = self.pending.get(response.request_id)
                if future is not None and not future.done():
                    future.set_result(response)
        except Exception as exc:  # a corrupt stream is as fatal as an exit
            reason = f"sent a malformed response ({exc})"
            await self._kill()
        finally:
            code = await self.proc.wait()
            self.death = f"tokenizer worker {self.index} (pid {self.pid}) {reason}; exit code {code}"
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(TokenizerWorkerDied(self.death))
            if not self._stopping:
                on_death(self)

    async def _kill(self) -> int:
        if self.proc.returncode is None:
            self.proc.kill()
        return await self.proc.wait()
