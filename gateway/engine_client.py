"""The gateway's side of engine.v1: one session stream, submits, aborts, and deltas per request.

One reader task owns the Connect stream: it resolves each step's token ids (from the output ring
or inline) and hands every delta to the queue of its request. If the stream breaks or falls
silent past the heartbeat timeout, every open request fails with EngineUnavailable at once, and
the client keeps reconnecting in the background; a new engine (or the same one restarted) brings
the service back without restarting the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine_svc.rpc.grpc_options import Keepalive, message_size_options
from engine_svc.rpc.shm_ring import TokenRing
from engine_svc.rpc.stall import StallDetector
from engine_svc.rpc.tls import ClientTLS
from gateway.stream_buffer import OutputBudget, delta_bytes
from llmserve_proto.engine.v1 import engine_pb2 as pb
from llmserve_proto.engine.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger("gateway.engine")
MAX_MESSAGE_BYTES = 64 << 20
# Admin calls (adapters, stats) only. Submit, Abort and SetPaused have no deadline of their own: they
# wait for the step in progress, which may rightly be long, and end with the session (``_lost``).
RPC_TIMEOUT_S = 30.0


class EngineUnavailable(Exception):
    pass


class EngineHung(EngineUnavailable):
    pass


def _loss_reason(e: BaseException) -> str:
    if isinstance(e, EngineHung):
        return "hung"
    if isinstance(e, TimeoutError):
        return "heartbeat_timeout"  # the engine process is frozen, or the link is
    if isinstance(e, EngineUnavailable):
        return "closed"  # the engine ended the session (its own watchdog, a shutdown)
    return "error"  # the connection broke (the engine died)


@dataclass(slots=True)
class EngineDelta:
    index: int
    token_ids: list[int]
    finish_reason: int  # engine.v1 FinishReason; 0 while running
    stop_token_id: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list  # engine.v1 TokenLogprob messages
    prompt_logprobs: list
    wire_bytes: int = 0  # about, for the stream's output budget
    request_finished: bool = False  # the engine says every output of the request has ended
    error: str = ""  # the engine refused the request after taking it (its grammar did not compile)
    num_draft_tokens: int = 0  # speculative decoding: the sequence's totals so far
    num_accepted_draft_tokens: int = 0
    embedding: bytes = b""  # an embedding request's vector (float32 LE), on its last delta


class RequestHandle:
    """The deltas of one submitted request, in order, grouped as they arrived (one engine step).
    What is queued and not yet taken is bounded by ``budget`` (stream_buffer.py): past it, the
    request is paused in the engine until the consumer catches up."""

    def __init__(self, request_id: str, n: int, budget: OutputBudget | None = None) -> None:
        self.request_id = request_id
        # Whether the engine still holds the request, as the engine says (``request_finished``):
        # ``finished`` as the consumer has seen it, ``engine_done`` as the session reader has (the
        # consumer may lag behind a slow client; the gateway's watchdog counts what the reader knows).
        self.finished = False
        self.engine_done = False
        self.budget = budget
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def paused(self) -> bool:
        return self.budget is not None and self.budget.paused

    def stalled_for(self, now: float) -> float:
        return self.budget.stalled_for(now) if self.budget is not None else 0.0

    def unread_since(self) -> float | None:
        """When its client stopped reading, while it is paused for that (None: it is not)."""
        return self.budget.unread_since() if self.budget is not None else None

    def sending(self, pending: bool) -> None:
        """The handler gave its client a message (True) and the client made room for it (False)."""
        if self.budget is not None:
            if pending:
                self.budget.send_started()
            else:
                self.budget.send_done()

    def watch_pause(self, callback: Callable[[bool], None]) -> None:
        """Tell ``callback`` each time the request is paused (True) or resumed (False)."""
        if self.budget is not None:
            self.budget.on_pause = callback
            if self.budget.paused:
                callback(True)

    def _put(self, item) -> None:
        if self.budget is not None and isinstance(item, EngineDelta):
            self.budget.added(item.wire_bytes, len(item.token_ids))
        self._queue.put_nowait(item)

    async def next_deltas(self) -> list[EngineDelta]:
        """Wait for the next deltas; raises EngineUnavailable if the engine went away."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        deltas = [item for item in items if isinstance(item, EngineDelta)]
        if self.budget is not None:
            self.budget.taken(
                len(deltas), sum(d.wire_bytes for d in deltas), sum(len(d.token_ids) for d in deltas)
            )
        out = []
        for item in items:
            if isinstance(item, Exception):
                raise item
            if item.request_finished:
                self.finished = True
            out.append(item)
        return out


class EngineClient:
    def __init__(
        self,
        address: str,
        gateway_id: str | None = None,
        use_shared_memory: bool = True,
        prompt_ring_bytes: int = 16 << 20,
        output_ring_bytes: int = 4 << 20,
        heartbeat_timeout_s: float = 5.0,
        reconnect_interval_s: float = 0.5,
        tls: ClientTLS | None = None,
        watchdog_timeout_s: float = 0.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        keepalive: Keepalive | None = None,
        max_unsent_messages: int = 0,  # per request; 0: no backpressure (no pausing in the engine)
        max_unsent_bytes: int = 0,
        max_unsent_tokens: int = 0,
        pause_after_s: float = 0.0,  # output untaken this long pauses the request too (0: never)
    ) -> None:
        self.address = address
        self.max_unsent = (max_unsent_messages, max_unsent_bytes, max_unsent_tokens)
        self.pause_after_s = pause_after_s
        self._pause_unsupported = False
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self.keepalive = keepalive or Keepalive()
        # The engine has work but neither its step counter nor its count of layers run moves: hung,
        # even if heartbeats go on.
        self._stall = StallDetector(watchdog_timeout_s)
        self.on_step_time: Callable[[float], None] | None = None  # metrics
        self.on_lost: Callable[[str], None] | None = None  # metrics: why a session ended
        self.gateway_id = gateway_id or f"gateway-{os.getpid()}"
        # Shared memory only makes sense on one host, which a unix socket guarantees.
        self.use_shared_memory = use_shared_memory and address.startswith("unix:")
        self._ring_bytes = (prompt_ring_bytes, output_ring_bytes) if self.use_shared_memory else (0, 0)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.info: pb.EngineInfo | None = None
        self.load = pb.Load()
        self.on_state_change: Callable[[bool], None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.EngineStub | None = None
        self._session_id = ""
        self._prompt_ring: TokenRing | None = None
        self._output_ring: TokenRing | None = None
        self._handles: dict[str, RequestHandle] = {}
        self._background: set[asyncio.Task] = set()
        self._calls: set[asyncio.Task] = set()  # the session's unary calls in flight: ended with it
        self._ready = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task | None = None
        self._stream = None
        self.last_event_at = 0.0

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def transport(self) -> str:
        return "shared-memory" if self._output_ring is not None else "grpc"

    async def start(self) -> None:
        options = [*message_size_options(self.max_message_bytes), *self.keepalive.client_options()]
        if self.tls is not None:
            self._channel = grpc.aio.secure_channel(
                self.address, self.tls.credentials(), options=options + self.tls.channel_options()
            )
        else:
            self._channel = grpc.aio.insecure_channel(self.address, options=options)
        self._stub = pb_grpc.EngineStub(self._channel)
        self._task = asyncio.create_task(self._maintain(), name="engine-session")

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def close(self) -> None:
        self._closed = True
        if self._stream is not None:
            self._stream.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._lost("the gateway is shutting down")
        if self._channel is not None:
            await self._channel.close()

    # Requests ------------------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: pb.SamplingParams,
        priority: int = 0,
        cache_salt: str = "",
        lora: str = "",
        client: str = "",
    ) -> RequestHandle:
        """Send a request; its deltas go to the returned handle. Raises EngineUnavailable, or
        grpc.aio.AioRpcError with INVALID_ARGUMENT when the engine refuses the request."""
        if not self.ready:
            raise EngineUnavailable("the engine is not available")
        handle = RequestHandle(request_id, params.n or 1, self._budget(request_id))
        self._handles[request_id] = handle  # before Submit: the first delta may beat its reply
        msg = pb.SubmitRequest(
            session_id=self._session_id,
            request_id=request_id,
            params=params,
            priority=priority,
            cache_salt=cache_salt,
            lora=lora,
            client=client,
        )
        start = self._prompt_ring.try_write(prompt) if self._prompt_ring is not None else None
        if start is not None:
            msg.prompt_span.start = start
            msg.prompt_span.length = len(prompt)
        else:
            msg.token_ids.ids.extend(prompt)
        call = self._start(self._stub.Submit, msg)
        try:
            await self._wait(call)
        except EngineUnavailable:
            self._handles.pop(request_id, None)
            raise
        except asyncio.CancelledError:
            # The client left mid-Submit. The Submit goes on regardless: the engine must consume
            # its prompt span (the ring releases in order, so one span never read would pin the
            # ring and grow the engine's list of out-of-order releases forever); once it lands,
            # the request is aborted so that it neither runs for nobody nor keeps its handle here.
            self._handles.pop(request_id, None)
            self._in_background(self._abort_when_submitted(call, request_id))
            raise
        except grpc.aio.AioRpcError as e:
            self._handles.pop(request_id, None)
            if e.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.CANCELLED,
            ):
                raise EngineUnavailable(f"the engine is not available: {e.details()}") from e
            raise
        return handle

    def _start(self, rpc, msg) -> asyncio.Task:
        """A unary call of this session. It has no deadline: the engine answers between two steps,
        and a step may rightly take longer than any fixed bound; the gateway's watchdog (heartbeats
        that show no progress) judges a hung engine, and losing the session cancels the call."""
        call = asyncio.ensure_future(rpc(msg))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        return call

    @staticmethod
    async def _wait(call: asyncio.Task):
        """``call``'s reply; ``EngineUnavailable`` when the session was lost first. The caller's own
        cancellation leaves the call running (``submit`` still has to see it land)."""
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if call.cancelled() and not (task is not None and task.cancelling()):
                raise EngineUnavailable("the engine session was lost") from None
            raise

    async def _abort_when_submitted(self, call, request_id: str) -> None:
        try:
            await call
        except Exception:  # noqa: BLE001 - refused or engine gone: nothing runs in the engine
            return
        await self.abort([request_id])

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # a reference, or the task could be collected mid-way
        task.add_done_callback(self._background.discard)

    def release(self, request_id: str) -> None:
        self._handles.pop(request_id, None)

    # Backpressure --------------------------------------------------------------------------------

    def _budget(self, request_id: str) -> OutputBudget | None:
        max_messages, max_bytes, max_tokens = self.max_unsent
        if max_messages <= 0 and max_bytes <= 0 and max_tokens <= 0:
            return None
        state = {"wanted": False, "sent": False, "task": None}

        def set_paused(paused: bool) -> None:
            # One sender per request, which always sends the latest wish: a pause and the resume
            # right after it can never reach the engine in the other order.
            state["wanted"] = paused
            if state["task"] is None:
                state["task"] = asyncio.get_running_loop().create_task(sync())
                self._background.add(state["task"])
                state["task"].add_done_callback(self._background.discard)

        async def sync() -> None:
            try:
                while state["sent"] != state["wanted"] and request_id in self._handles:
                    wanted = state["wanted"]
                    await self.set_paused([request_id], wanted)
                    state["sent"] = wanted
            finally:
                state["task"] = None

        return OutputBudget(
            max_messages or 1 << 30,
            max_bytes or 1 << 62,
            set_paused,
            pause_after_s=self.pause_after_s,
            max_tokens=max_tokens or 1 << 30,
        )

    async def set_paused(self, request_ids: list[str], paused: bool) -> None:
        """Pause (or resume) requests in the engine; a failure only leaves them running."""
        if not self.ready or self._pause_unsupported:
            return
        msg = pb.SetPausedRequest(session_id=self._session_id, request_ids=request_ids, paused=paused)
        try:
            await self._wait(self._start(self._stub.SetPaused, msg))
        except EngineUnavailable:
            return  # the session's requests ended with it
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._pause_unsupported = True  # an older engine: slow readers only buffer here
                log.warning("the engine at %s cannot pause requests (no SetPaused)", self.address)
            else:
                log.debug("SetPaused(%s) of %s failed: %s", paused, request_ids, e.details())

    async def abort(self, request_ids: list[str], index: int | None = None) -> None:
        """Abort requests (or, with ``index``, one sequence of one request) in the engine."""
        if index is None:
            for rid in request_ids:
                self._handles.pop(rid, None)
        if not self.ready or not request_ids:
            return
        msg = pb.AbortRequest(session_id=self._session_id, request_ids=request_ids, index=index)
        try:
            await self._wait(self._start(self._stub.Abort, msg))
        except EngineUnavailable:
            return  # the engine closed the session: its requests are aborted with it
        except grpc.aio.AioRpcError as e:
            log.warning("abort of %s failed: %s", request_ids, e.details())

    # LoRA adapters: errors are the engine's grpc.aio.AioRpcError (INVALID_ARGUMENT, NOT_FOUND, ...)

    async def load_adapter(self, name: str, path: str) -> pb.AdapterInfo:
        self._check_ready()
        return await self._stub.LoadAdapter(
            pb.LoadAdapterRequest(name=name, path=path), timeout=RPC_TIMEOUT_S
        )

    async def unload_adapter(self, name: str) -> None:
        self._check_ready()
        await self._stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=RPC_TIMEOUT_S)

    async def list_adapters(self) -> pb.ListAdaptersResponse:
        self._check_ready()
        return await self._stub.ListAdapters(pb.ListAdaptersRequest(), timeout=RPC_TIMEOUT_S)

    def _check_ready(self) -> None:
        if not self.ready:
            raise EngineUnavailable("the engine is not available")

    async def stats(self, check_invariants: bool = False) -> pb.EngineStats:
        return await self._stub.GetStats(pb.GetStatsRequest(check_invariants=check_invariants), timeout=10)

    def kv_events(self, max_buffered_batches: int = 0):
        """The engine's KV-event stream (a call to iterate; cancel it to unsubscribe)."""
        return self._stub.StreamKvEvents(pb.KvEventsRequest(max_buffered_batches=max_buffered_batches))

    # The session ---------------------------------------------------------------------------------

    async def _maintain(self) -> None:
        while not self._closed:
            try:
                await self._run_session()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure means: engine gone, try again
                reason = _loss_reason(e)
                if self.ready:
                    log.error("lost the engine at %s (%s): %s", self.address, reason, e or type(e).__name__)
                    if self.on_lost is not None:
                        self.on_lost(reason)
                self._lost(f"the engine is unavailable ({reason})")
            if not self._closed:
                await asyncio.sleep(self.reconnect_interval_s)

    async def _run_session(self) -> None:
        stream = self._stub.Connect(
            pb.ConnectRequest(
                gateway_id=self.gateway_id,
                prompt_ring_bytes=self._ring_bytes[0],
                output_ring_bytes=self._ring_bytes[1],
            ),
            wait_for_ready=False,
        )
        self._stream = stream
        try:
            first = await asyncio.wait_for(stream.read(), self.heartbeat_timeout_s * 4)
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "connected":
                raise EngineUnavailable("the engine did not open a session")
            c = first.connected
            self.info, self._session_id = c.info, c.session_id
            if c.HasField("rings"):
                self._prompt_ring = TokenRing.attach(c.rings.prompt_ring)
                self._output_ring = TokenRing.attach(c.rings.output_ring)
            self.last_event_at = time.monotonic()
            self._stall.update(self.last_event_at, pending=False, progressed=True)
            last_steps = last_layers = None
            self._ready.set()
            log.info(
                "engine session %s on %s (transport: %s)", self._session_id, self.address, self.transport
            )
            if self.on_state_change:
                self.on_state_change(True)
            while True:
                event = await asyncio.wait_for(stream.read(), self.heartbeat_timeout_s)
                if event is grpc.aio.EOF:
                    raise EngineUnavailable("the engine closed the session")
                now = self.last_event_at = time.monotonic()
                kind = event.WhichOneof("kind")
                if kind == "step":
                    if event.step.HasField("load"):  # busy: no heartbeats, the load comes with steps
                        self.load = event.step.load
                    self._dispatch(event.step)
                    self._stall.update(now, pending=True, progressed=True)
                    if self.on_step_time is not None and event.step.step_time_s > 0:
                        self.on_step_time(event.step.step_time_s)
                elif kind == "heartbeat":
                    self.load = load = event.heartbeat.load
                    # The load may predate the last submits (it is refreshed between steps, and a
                    # stuck loop refreshes nothing), so the requests this gateway knows are
                    # running count too.
                    # Paused requests take no steps by design: they are not work the engine owes.
                    pending = load.num_running + load.num_waiting - load.num_paused > 0 or any(
                        not h.engine_done and not h.paused for h in self._handles.values()
                    )
                    # A long step shows as layers run while the step counter stands still; a
                    # starved one (other processes have the CPU) as the engine's word for it.
                    layers = event.heartbeat.layers_run
                    progressed = (
                        load.num_steps != last_steps or layers != last_layers or event.heartbeat.starved
                    )
                    self._stall.update(now, pending=pending, progressed=progressed)
                    last_steps, last_layers = load.num_steps, layers
                    if self._stall.stalled(now):
                        raise EngineHung(
                            f"no engine step for {self._stall.stalled_for(now):.1f}s while it has work"
                        )
        finally:
            stream.cancel()
            self._stream = None

    def _dispatch(self, step: pb.StepOutput) -> None:
        ids = (
            self._output_ring.read_and_release(step.output_span.start, step.output_span.length)
            if step.in_ring
            else None
        )
        pos = 0
        for d in step.deltas:
            if ids is not None:
                tokens = ids[pos : pos + d.num_token_ids]
                pos += d.num_token_ids
            else:
                tokens = list(d.token_ids)
            handle = self._handles.get(d.request_id)
            if handle is None:
                continue  # aborted here after the engine stepped it
            if d.request_finished:
                handle.engine_done = True
            handle._put(
                EngineDelta(
                    index=d.index,
                    token_ids=tokens,
                    finish_reason=d.finish_reason,
                    stop_token_id=d.stop_token_id if d.HasField("stop_token_id") else None,
                    num_prompt_tokens=d.num_prompt_tokens,
                    num_cached_tokens=d.num_cached_tokens,
                    logprobs=list(d.logprobs),
                    prompt_logprobs=list(d.prompt_logprobs),
                    wire_bytes=delta_bytes(tokens, d.logprobs, d.prompt_logprobs),
                    request_finished=d.request_finished,
                    error=d.error,
                    num_draft_tokens=d.num_draft_tokens,
                    num_accepted_draft_tokens=d.num_accepted_draft_tokens,
                    embedding=d.embedding,
                )
            )

    def _lost(self, reason: str) -> None:
        was_ready = self._ready.is_set()
        self._ready.clear()
        for ring in (self._prompt_ring, self._output_ring):
            if ring is not None:
                ring.close()
        self._prompt_ring = self._output_ring = None
        handles, self._handles = self._handles, {}
        for h in handles.values():
            h._put(EngineUnavailable(reason))
        for call in list(self._calls):
            call.cancel()
        if was_ready and self.on_state_change:
            self.on_state_change(False)
